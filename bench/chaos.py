"""Chaos: what clients see while parts of the serving stack fail under load.

The soak's stack (``bench/soak.py``: a redis-server KV tier, replica ``a`` with
``--api-server-count 2``, replica ``b``, a ``ferry router --policy least_load`` over both), a steady
load of chat and completions through the router (streamed and not, ``--concurrency`` clients), and
during it, one after another (``--faults`` picks and orders them): ``b`` killed (SIGKILL) and
started again on its port; ``b`` stopped (SIGSTOP) for ``--pause`` seconds, then continued; with
``--pd N`` (a ``--role prefill`` and a ``--role decode`` replica behind a second, PD router, taking
N of the clients) the prefill worker killed and restarted, the decode worker likewise, the decode
worker stopped; Redis killed and started again on its port; Redis down for ``--pause`` seconds;
Redis stopped (SIGSTOP: a hung tier, not a refusing one); one API server process of ``a`` killed
(its supervisor starts another); ``a``'s engine process killed (the supervisor stops the replica,
which is started again as an orchestrator would).

Every answer is judged: a 200 with a whole answer (non-streamed: JSON whose every choice has a
``finish_reason``; streamed: ``data: [DONE]`` last), a clean refusal (4xx/5xx with OpenAI's
``{"error": {...}}``) or a stream ended by an error event are fine; a client timeout (a hung
request), a body that is not JSON, a stream cut without ``[DONE]`` or an error event, or a broken
connection are not. After each fault it waits for ``--probe-ok`` straight 200s through the router
(within ``--recover`` seconds). Then, after ``--settle`` seconds, the soak's idle checks (requests
running / waiting 0, KV usage back, ``/load`` 0, router in-flight 0; with ``--pd`` the pair's too)
and no socket left in CLOSE_WAIT (but Redis'); fds are shown before and after. It prints the outcomes per phase
and every ERROR / WARNING / Traceback line of every log; a bad outcome, a slow recovery, a gauge not
idle, a CLOSE_WAIT socket or a Traceback exits 1.

    .venv/bin/python bench/chaos.py [--concurrency 10] [--pd 4] [--pause 4] [--faults kill-b,stop-redis]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.local_redis import RedisProcess  # noqa: E402
from bench.soak import Proc, not_idle, snapshot, wait_healthy  # noqa: E402
from bench.soak_mix import MODEL, dechunk, prompt  # noqa: E402

FAULTS = (
    "kill-b",
    "stop-b",
    "kill-prefill",
    "kill-decode",
    "stop-decode",
    "redis-restart",
    "redis-down",
    "stop-redis",
    "kill-api-server",
    "kill-engine",
)
TIMEOUT = 60.0  # a client's limit for one request: longer means it hung


# ---------------------------------------------------------------- judging one answer


def judge(status: int, headers: dict[str, str], data: bytes, stream: bool) -> str:
    """``ok``, ``refused-<status>: <message>``, ``stream-error`` or ``BAD-<why>``."""
    if status >= 400:
        try:
            err = json.loads(data)["error"]
            assert isinstance(err["message"], str) and err["message"]
        except (ValueError, KeyError, TypeError, AssertionError):
            return f"BAD-{status}-not-openai-error"
        return f"refused-{status}: {err['message'][:70]}"
    if status != 200:
        return f"BAD-status-{status}"
    if not stream:
        try:
            answer = json.loads(data)
        except ValueError:
            return "BAD-truncated-json"
        choices = answer.get("choices") or []
        if not choices or any(c.get("finish_reason") is None for c in choices):
            return "BAD-incomplete-choices"
        return "ok"
    events = [ln[6:] for ln in data.decode(errors="replace").split("\n") if ln.startswith("data: ")]
    if not events:
        return "BAD-empty-stream"
    errored = any('"error"' in e and e.startswith('{"error"') for e in events)
    if events[-1] == "[DONE]":
        return "stream-error" if errored else "ok"
    return "stream-error-no-done" if errored else "BAD-stream-cut"


async def request(port: int, rng: random.Random) -> tuple[str, float]:
    stream = rng.random() < 0.5
    if rng.random() < 0.5:
        path = "/v1/chat/completions"
        body: dict[str, Any] = {"messages": [{"role": "user", "content": prompt(rng)}]}
    else:
        path = "/v1/completions"
        body = {"prompt": prompt(rng), "n": rng.choice([1, 1, 2])}
    # Long enough that a fault meets streams part-way (the demo model makes ~100 tokens/s each).
    body |= {"model": MODEL, "max_tokens": rng.randint(4, 160), "stream": stream}
    if rng.random() < 0.3:
        body["ignore_eos"] = True
    raw = json.dumps(body).encode()
    start = time.monotonic()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
    except (OSError, asyncio.TimeoutError) as e:
        return f"BAD-connect-{type(e).__name__}", 0.0
    try:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n"
        )
        writer.write(head.encode() + raw)
        async with asyncio.timeout(TIMEOUT):
            await writer.drain()
            status_line = await reader.readline()
            headers: dict[str, str] = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                key, _, value = line.decode().partition(":")
                headers[key.strip().lower()] = value.strip()
            data = await reader.read()
        if not status_line:
            return "BAD-no-status-line", time.monotonic() - start
        status = int(status_line.split()[1])
        if headers.get("transfer-encoding") == "chunked":
            try:
                data = dechunk(data)
            except (ValueError, IndexError):
                return "BAD-broken-chunking", time.monotonic() - start
        elif "content-length" in headers and len(data) != int(headers["content-length"]):
            return "BAD-short-body", time.monotonic() - start
        return judge(status, headers, data, stream), time.monotonic() - start
    except TimeoutError:
        return "BAD-hung", time.monotonic() - start
    except OSError as e:
        return f"BAD-{type(e).__name__}", time.monotonic() - start
    finally:
        writer.close()


# ---------------------------------------------------------------- load and faults


class Load:
    def __init__(self, port: int, concurrency: int, seed: int) -> None:
        self.port, self.phase = port, "warm"
        self.outcomes: dict[str, dict[str, int]] = {}
        self.slowest: dict[str, float] = {}
        self.running = True
        self.tasks = [asyncio.create_task(self._worker(random.Random(seed + w))) for w in range(concurrency)]

    async def _worker(self, rng: random.Random) -> None:
        while self.running:
            outcome, seconds = await request(self.port, rng)
            phase = self.phase  # the phase it ended in: a fault shows where it met requests
            counts = self.outcomes.setdefault(phase, {})
            counts[outcome] = counts.get(outcome, 0) + 1
            self.slowest[phase] = max(self.slowest.get(phase, 0.0), round(seconds, 1))

    async def stop(self) -> None:
        self.running = False
        await asyncio.gather(*self.tasks)


async def recovered(port: int, want: int, limit: float) -> float | None:
    """Seconds until ``want`` requests in a row answered 200 whole; None past ``limit``."""
    start, rng, streak = time.monotonic(), random.Random(7), 0
    while time.monotonic() - start < limit:
        outcome, _ = await request(port, rng)
        streak = streak + 1 if outcome == "ok" else 0
        if streak >= want:
            return round(time.monotonic() - start, 1)
        if outcome != "ok":
            await asyncio.sleep(0.2)
    return None


def start_redis(port: int, workdir: str) -> subprocess.Popen:
    cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen([*cmd, "--dir", workdir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.3)
    return proc


def spawned_pids(proc: Proc) -> list[int]:
    """The supervisor's spawned children, oldest first: the engine process, then the API servers."""
    kids = [
        p
        for p in psutil.Process(proc.proc.pid).children()
        if "spawn_main" in " ".join(p.cmdline()) and "resource_tracker" not in " ".join(p.cmdline())
    ]
    return [p.pid for p in sorted(kids, key=lambda p: p.create_time())]


async def pd_not_idle(ports: dict[str, int]) -> list[str]:
    """The PD pair's and PD router's gauges not back to idle."""
    from bench.soak import metric_lines
    from bench.soak_mix import http

    problems = []
    for name in ("p", "d"):
        _, _, text = await http("GET", ports[name], "/metrics")
        gauges = metric_lines(text.decode(), ("vllm:num_requests_running", "vllm:num_requests_waiting"))
        problems += [f"replica {name}: {k} = {v}" for k, v in gauges.items() if v != 0]
        _, _, load = await http("GET", ports[name], "/load")
        if json.loads(load)["server_load"] != 0:
            problems.append(f"replica {name}: /load = {json.loads(load)['server_load']}")
    _, _, text = await http("GET", ports["pd"], "/metrics")
    gauges = metric_lines(text.decode(), ("ferry:router_inflight",))
    problems += [f"pd router: {k} = {v}" for k, v in gauges.items() if v != 0]
    _, _, admin = await http("GET", ports["pd"], "/admin/replicas")
    for r in json.loads(admin)["replicas"]:
        problems += [f"pd router: {r['url']} {k} = {r[k]}" for k in ("inflight", "prefilling") if r.get(k)]
    return problems


def scan(logs: dict[str, Path]) -> dict[str, list[str]]:
    found = {}
    for name, path in logs.items():
        lines = path.read_text(errors="replace").splitlines() if path.exists() else []
        bad = [ln for ln in lines if re.search(r"\b(ERROR|WARNING|CRITICAL)\b|Traceback", ln)]
        if bad:
            found[name] = bad[:25] + ([f"... {len(bad) - 25} more"] if len(bad) > 25 else [])
    return found


async def main_async(args: argparse.Namespace) -> int:
    from engine.demo import build_model

    work = Path(tempfile.mkdtemp(prefix="ferry-chaos-"))
    model = build_model(work / MODEL)
    redis = RedisProcess()
    redis_port = redis.port
    tier = f"redis://127.0.0.1:{redis_port}/0"
    from bench.local_redis import free_port

    ports = {n: free_port() for n in ("a", "b", "router", "p", "d", "pd")}
    py = [sys.executable, "-m", "ferry"]
    common = ["--model", str(model), "--num-threads", "1", "--kv-tier", tier, "--num-kv-blocks", "256"]
    serve = {
        "a": [*py, "serve", *common, "--port", str(ports["a"]), "--api-server-count", "2"],
        "b": [*py, "serve", *common, "--port", str(ports["b"])],
        "p": [*py, "serve", *common, "--port", str(ports["p"]), "--role", "prefill"],
        "d": [*py, "serve", *common, "--port", str(ports["d"]), "--role", "decode"],
    }
    logs: dict[str, Path] = {}
    procs: dict[str, Proc] = {}

    def start(name: str, log: str) -> None:
        logs[log] = work / f"{log}.log"
        procs[name] = Proc(name, serve[name], logs[log])

    problems: list[str] = []
    recoveries: dict[str, float | None] = {}
    try:
        start("a", "a")
        start("b", "b")
        await wait_healthy(ports["a"])
        await wait_healthy(ports["b"])
        logs["router"] = work / "router.log"
        replicas = [x for n in ("a", "b") for x in ("--replica", f"http://127.0.0.1:{ports[n]}")]
        procs["router"] = Proc(
            "router",
            [*py, "router", "--port", str(ports["router"]), "--policy", "least_load", *replicas],
            logs["router"],
        )
        await wait_healthy(ports["router"])
        if args.pd:
            for name in ("p", "d"):
                start(name, name)
            await wait_healthy(ports["p"])
            await wait_healthy(ports["d"])
            logs["pd"] = work / "pd.log"
            pd_cmd = [*py, "router", "--port", str(ports["pd"]), "--kv-tier", tier, "--pd-threshold", "8"]
            pd_cmd += [
                "--prefill",
                f"http://127.0.0.1:{ports['p']}",
                "--decode",
                f"http://127.0.0.1:{ports['d']}",
            ]
            procs["pd"] = Proc("pd", pd_cmd, logs["pd"])
            await wait_healthy(ports["pd"])
        warm = [Load(ports["router"], args.concurrency - args.pd, args.seed + 99)]
        if args.pd:
            warm.append(Load(ports["pd"], args.pd, args.seed + 98))
        await asyncio.sleep(args.phase)
        for w in warm:  # pools, caches: in "before"
            await w.stop()
        await asyncio.sleep(args.settle)
        before = await snapshot(procs, ports, redis_port, None)
        fds_before = {k: v.get("fds") for k, v in before["processes"].items()}
        loads = [Load(ports["router"], args.concurrency - args.pd, args.seed)]
        if args.pd:
            loads.append(Load(ports["pd"], args.pd, args.seed + 50))
        await asyncio.sleep(args.phase)

        async def fault(name: str, action, router: str = "router") -> None:  # noqa: ANN001
            for load in loads:
                load.phase = name
            print(f"[{time.strftime('%H:%M:%S')}] fault: {name}", flush=True)
            await action()
            for r in ("router", "pd") if args.pd else ("router",):
                recoveries[f"{name}@{r}"] = took = await recovered(ports[r], args.probe_ok, args.recover)
                if took is None:
                    problems.append(
                        f"{name}: no {args.probe_ok} straight 200s from {r} within {args.recover} s"
                    )
            await asyncio.sleep(args.phase)

        def kill(name: str):  # noqa: ANN202
            async def action() -> None:
                procs[name].proc.kill()
                await asyncio.to_thread(procs[name].proc.wait)
                procs[name]._out.close()
                await asyncio.sleep(args.pause)
                start(name, f"{name}-restarted")
                await wait_healthy(ports[name])

            return action

        def pause(name: str):  # noqa: ANN202
            async def action() -> None:
                os.kill(procs[name].proc.pid, signal.SIGSTOP)
                await asyncio.sleep(args.pause)
                os.kill(procs[name].proc.pid, signal.SIGCONT)

            return action

        async def restart_redis() -> None:
            nonlocal redis
            redis.proc.kill()
            redis.proc.wait()
            redis.proc = start_redis(redis_port, redis.dir)

        async def redis_down() -> None:
            redis.proc.kill()
            redis.proc.wait()
            await asyncio.sleep(args.pause)
            redis.proc = start_redis(redis_port, redis.dir)

        async def kill_api_server() -> None:
            pids = spawned_pids(procs["a"])[1:]
            print(f"    API servers of a: {pids}; killing {pids[0]}", flush=True)
            os.kill(pids[0], signal.SIGKILL)
            await asyncio.sleep(args.pause)

        async def stop_redis() -> None:
            redis.proc.send_signal(signal.SIGSTOP)
            await asyncio.sleep(args.pause)
            redis.proc.send_signal(signal.SIGCONT)

        async def kill_engine() -> None:
            engine = spawned_pids(procs["a"])[0]
            print(f"    engine process of a: {engine}", flush=True)
            os.kill(engine, signal.SIGKILL)
            await asyncio.to_thread(
                procs["a"].proc.wait, 60
            )  # the supervisor stops the replica (its orchestrator restarts it)
            procs["a"]._out.close()
            start("a", "a-restarted")
            await wait_healthy(ports["a"])

        faults = {
            "kill-b": kill("b"),
            "stop-b": pause("b"),
            "kill-prefill": kill("p"),
            "kill-decode": kill("d"),
            "stop-decode": pause("d"),
            "redis-restart": restart_redis,
            "redis-down": redis_down,
            "stop-redis": stop_redis,
            "kill-api-server": kill_api_server,
            "kill-engine": kill_engine,
        }
        for name in args.faults.split(","):
            if name in ("kill-prefill", "kill-decode", "stop-decode") and not args.pd:
                continue
            await fault(name, faults[name])
        for load in loads:
            load.phase = "after"
        await asyncio.sleep(args.phase)
        for load in loads:
            await load.stop()
        await asyncio.sleep(args.settle)
        after = await snapshot(procs, ports, redis_port, None)
        problems += not_idle(before, after)
        if args.pd:
            problems += await pd_not_idle(ports)
        # Connections the peer closed but a process never did (CLOSE_WAIT) are what a leak leaves;
        # fd counts move with the connection pools, so they are shown, not judged. Those to Redis
        # are noted only: redis-py's pool finds them dead when it hands them out next.
        for name, proc in procs.items():
            for p in proc.tree():
                try:
                    stuck = [c for c in p.net_connections() if c.status == psutil.CONN_CLOSE_WAIT]
                except psutil.Error:
                    continue
                peers = sorted({c.raddr.port for c in stuck if c.raddr})
                if peers == [redis_port]:
                    print(f"note: {name} pid {p.pid}: {len(stuck)} idle Redis connections in CLOSE_WAIT")
                elif stuck:
                    problems.append(
                        f"{name} pid {p.pid}: {len(stuck)} sockets in CLOSE_WAIT (to ports {peers})"
                    )
        report = {
            f"{name}:{k}": getattr(load, k)
            for name, load in zip(("router", "pd"), loads, strict=False)
            for k in ("outcomes", "slowest")
        }
        print(json.dumps({**report, "recovery_s": recoveries}, indent=1))
        print(
            "fds before/after:", {k: (fds_before.get(k), v.get("fds")) for k, v in after["processes"].items()}
        )
        for load in loads:
            for phase, counts in load.outcomes.items():
                for outcome, n in counts.items():
                    if outcome.startswith("BAD"):
                        problems.append(f"{phase}: {n} x {outcome}")
        found = scan(logs)
        for name, lines in found.items():
            print(f"--- {name}.log")
            for ln in lines:
                print("   ", ln[:220])
                if "Traceback" in ln:
                    problems.append(f"{name}: a traceback in the log")
        print("logs:", work, "ports:", ports, "redis:", redis_port)
        for problem in dict.fromkeys(problems):
            print("PROBLEM:", problem)
        return 1 if problems else 0
    finally:
        for proc in reversed(procs.values()):
            if proc.proc.poll() is None:
                os.kill(proc.proc.pid, signal.SIGCONT)
            proc.stop()
        redis.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--pause", type=float, default=4.0, help="seconds a stopped part stays down")
    p.add_argument("--phase", type=float, default=8.0, help="seconds of load between faults")
    p.add_argument("--probe-ok", type=int, default=3, help="straight 200s that count as recovered")
    p.add_argument("--recover", type=float, default=30.0, help="seconds allowed to recover")
    p.add_argument("--settle", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--faults", default=",".join(FAULTS), help="which faults, in order (comma-separated)")
    p.add_argument(
        "--pd",
        type=int,
        default=0,
        help="add a prefill + decode pair behind a PD router, with this many of the clients",
    )
    args = p.parse_args()
    if args.concurrency > 12:
        p.error("--concurrency is capped at 12 (a shared machine)")
    if not 0 <= args.pd < args.concurrency:
        p.error("--pd must leave the mixed router at least one client")
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
