"""Soak: resource leaks under churn in the serving stack.

Starts, on loopback only, a private redis-server (the KV tier), two ``ferry serve`` replicas of the
tiny demo model — ``a`` with ``--api-server-count 2``; ``b`` with ``--max-num-seqs 4``,
``--max-queued-requests 2`` (so it answers 429s) and ``--request-timeout 1`` — and a ``ferry
router`` over them (``--max-concurrency 10 --max-queue 2``: it refuses some too). Each round sends
``--requests`` mixed requests, ``--concurrency`` at a time, 70 % through the router and 15 % straight
to each replica: completions, chat, Responses (stored, background, background streams, cancelled)
and Anthropic messages, streamed and not, ``n > 1``, logprobs, stop strings, structured outputs,
tool calls, beam search, long generations, bad bodies. About 30 % of the clients hang up at a random
point (right after sending, after the status line, part-way through the body, just before its
end); half the workers keep their connections alive between requests.

Before the load and after each round (after ``--settle`` seconds) it records per process RSS, open
fds and threads; the replicas' gauges (``vllm:num_requests_running`` / ``_waiting``,
``vllm:kv_cache_usage_perc``, background responses running, stored responses) and ``/load``; the
router's ``ferry:router_inflight``, ``/load`` and ``/admin/replicas`` counters; Redis' client
count, memory and keys. ``--objects`` adds, through a ``sitecustomize`` signal hook (nothing changed
in the code under test): asyncio tasks, live objects by type, and the sizes of the containers
ferry's own objects hold (what a request left behind shows there); ``FERRY_SOAK_TRACEMALLOC=1``
adds tracemalloc's allocation sites. It prints a table (a column per snapshot), what grew every
round, and the ERROR / Traceback lines of every log; a gauge not back to idle or such a log line
makes the exit status 1 (an API server's report that its engine process was silent for a while,
then heard from again, is listed apart as an ``engine_stalls`` entry: a process starved of CPU). Every process it starts is stopped; it ends by itself.

    .venv/bin/python bench/soak.py [--requests 1500] [--rounds 2] [--concurrency 12] [--objects]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
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

from bench.local_redis import RedisProcess, free_port  # noqa: E402
from bench.soak_mix import MODEL, http, run_load  # noqa: E402

HOOK = Path(__file__).resolve().parent / "soak_hook"  # its sitecustomize.py: --objects

# ---------------------------------------------------------------- processes


class Proc:
    def __init__(self, name: str, cmd: list[str], log: Path, hook_dir: Path | None = None) -> None:
        self.name, self.log = name, log
        env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
        if hook_dir is not None:  # where the hook writes its dumps
            env["PYTHONPATH"] = f"{HOOK}{os.pathsep}{REPO}"
            env["FERRY_SOAK_DUMPS"] = str(hook_dir)
            if os.environ.get("FERRY_SOAK_TRACEMALLOC"):
                env["PYTHONTRACEMALLOC"] = "1"
        self._out = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._out, stderr=subprocess.STDOUT)

    def tree(self) -> list[psutil.Process]:
        root = psutil.Process(self.proc.pid)
        return [root, *root.children(recursive=True)]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()


async def wait_healthy(port: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            status, _, _ = await http("GET", port, "/health", timeout=2)
            if status == 200:
                return
        except (OSError, asyncio.TimeoutError, ValueError):
            pass
        await asyncio.sleep(0.3)
    raise SystemExit(f"port {port} did not become healthy")


# ---------------------------------------------------------------- measurements


def metric_lines(text: str, names: tuple[str, ...]) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith(names):
            key, _, value = line.rpartition(" ")
            key = re.sub(r'model_name="[^"]*",?', "", key).replace("{}", "")
            out[key] = float(value)
    return out


async def dump_objects(pids: list[int], hook_dir: Path) -> dict[int, dict[str, Any]]:
    """SIGUSR2 to each process, then its dump (``bench/soak_hook/sitecustomize.py``)."""
    for pid in pids:
        (hook_dir / f"{pid}.json").unlink(missing_ok=True)
        os.kill(pid, signal.SIGUSR2)
    dumps: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + 30
    while len(dumps) < len(pids) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        for pid in pids:
            path = hook_dir / f"{pid}.json"
            if pid not in dumps and path.exists():
                dumps[pid] = json.loads(path.read_text())
    return dumps


async def snapshot(
    procs: dict[str, Proc], ports: dict[str, int], redis_port: int, hook_dir: Path | None
) -> dict[str, Any]:
    snap: dict[str, Any] = {"processes": {}, "objects": {}}
    trees = {name: proc.tree() for name, proc in procs.items()}
    dumps = {}
    if hook_dir is not None:
        pids = [p.pid for tree in trees.values() for p in tree if "python" in p.name()]
        dumps = await dump_objects(pids, hook_dir)
    for name, tree in trees.items():
        for i, p in enumerate(tree):
            if p.pid in dumps and "error" in dumps[p.pid]:
                print(f"{name}[{i}]: the object dump failed: {dumps[p.pid]['error']}", file=sys.stderr)
            elif p.pid in dumps:
                snap["objects"][f"{name}[{i}]"] = dumps[p.pid]["objects"]
                snap.setdefault("mem", {})[f"{name}[{i}]"] = dumps[p.pid]["mem"]
                snap.setdefault("state", {})[f"{name}[{i}]"] = dumps[p.pid]["state"]
                if dumps[p.pid]["tasks"] is not None:
                    snap["processes"].setdefault(f"{name}[{i}]", {})["asyncio_tasks"] = dumps[p.pid]["tasks"]
            try:
                with p.oneshot():
                    snap["processes"].setdefault(f"{name}[{i}]", {}).update(
                        rss_mib=round(p.memory_info().rss / 2**20, 1),
                        fds=p.num_fds(),
                        threads=p.num_threads(),
                    )
            except psutil.Error:
                pass
    engine_names = (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "ferry:responses_background_running",
        "ferry:responses_stored",
        "vllm:request_success_total",
    )
    for name in ("a", "b"):
        _, _, text = await http("GET", ports[name], "/metrics")
        snap[f"{name}_metrics"] = metric_lines(text.decode(), engine_names)
        _, _, load = await http("GET", ports[name], "/load")
        snap[f"{name}_load"] = json.loads(load)["server_load"]
    _, _, text = await http("GET", ports["router"], "/metrics")
    snap["router_metrics"] = metric_lines(
        text.decode(), ("ferry:router_inflight", "ferry:router_request_latency_seconds_count")
    )
    _, _, load = await http("GET", ports["router"], "/load")
    snap["router_load"] = json.loads(load)["server_load"]
    _, _, admin = await http("GET", ports["router"], "/admin/replicas")
    snap["router_replicas"] = [
        {
            k: v
            for k, v in r.items()
            if k in ("url", "inflight", "inflight_tokens", "prefilling", "health", "circuit")
        }
        for r in json.loads(admin)["replicas"]
    ]
    import redis

    r = redis.Redis(port=redis_port)
    snap["redis_clients"] = len(r.client_list())
    snap["redis_used_memory"] = r.info("memory")["used_memory"]
    snap["redis_keys"] = r.dbsize()
    r.close()
    return snap


# An API server's watchdog on its engine process (server/engine_client.py): an ERROR when it heard
# nothing for ENGINE_SILENCE_S, a WARNING when it hears from it again. On a machine starved of CPU
# (the soak's processes beside other work on two cores) the engine process can be descheduled
# that long and recover: a stall the soak reports apart, not a failure. One never heard from
# again stays a failure.
_SILENT = "the engine process sent nothing for"
_HEARD_AGAIN = "the engine process is heard from again"


def scan_logs(logs: dict[str, Path]) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Each log's ERROR / Traceback / CRITICAL lines, and apart from them the engine-silence
    errors its API server recovered from (heard from the engine process again later in the log)."""
    found, stalls = {}, {}
    for name, path in logs.items():
        lines = path.read_text(errors="replace").splitlines()
        bad, recovered = [], []
        for i, ln in enumerate(lines):
            if not re.search(r"\bERROR\b|Traceback|CRITICAL", ln):
                continue
            if _SILENT in ln and any(_HEARD_AGAIN in later for later in lines[i + 1 :]):
                recovered.append(ln)
            else:
                bad.append(ln)
        if bad:
            found[name] = bad[:20] + ([f"... {len(bad) - 20} more"] if len(bad) > 20 else [])
        if recovered:
            stalls[name] = recovered
    return found, stalls


def not_idle(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """What is not back to idle after the settle period: requests running, waiting or held
    anywhere, KV blocks still in use, background responses still running."""
    problems = []
    for name in ("a", "b"):
        for key, value in after[f"{name}_metrics"].items():
            idle = before[f"{name}_metrics"].get(key) if key.startswith("vllm:kv_cache_usage") else 0.0
            gauge = key.startswith(
                ("vllm:num_requests", "vllm:kv_cache", "ferry:responses_background_running")
            )
            if gauge and value != idle:
                problems.append(f"replica {name}: {key} = {value}, idle {idle}")
        if after[f"{name}_load"] != 0:
            problems.append(f"replica {name}: /load = {after[f'{name}_load']}")
    if after["router_load"] != 0:
        problems.append(f"router: /load = {after['router_load']}")
    for key, value in after["router_metrics"].items():
        if key.startswith("ferry:router_inflight") and value != 0:
            problems.append(f"router: {key} = {value}")
    for r in after["router_replicas"]:
        for key in ("inflight", "inflight_tokens", "prefilling"):
            if r[key] != 0:
                problems.append(f"router: {r['url']} {key} = {r[key]}")
    return problems


def flatten(snap: dict[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for proc, values in snap["processes"].items():
        for k, v in values.items():
            flat[f"{proc}.{k}"] = v
    for key, value in snap.items():
        if key in ("processes", "objects", "mem", "state"):
            continue
        if isinstance(value, dict):
            for k, v in value.items():
                flat[f"{key[0]}:{k}"] = v
        elif isinstance(value, list):
            for r in value:
                for k in ("inflight", "inflight_tokens", "prefilling"):
                    flat[f"router:{r['url'][-5:]}.{k}"] = r[k]
        else:
            flat[key] = value
    return flat


def print_object_growth(snaps: list[dict[str, Any]], top: int = 12) -> None:
    """Per process, the object types whose count grew over every round (a leak grows each round)."""
    for proc in snaps[0]["objects"]:
        series = [s["objects"].get(proc, {}) for s in snaps]
        grown = []
        for kind in set().union(*series):
            counts = [c.get(kind, 0) for c in series]
            if all(b > a for a, b in zip(counts[1:], counts[2:], strict=False)) and counts[-1] > counts[0]:
                grown.append((counts[-1] - counts[0], kind, counts))
        if grown:
            print(f"{proc}: object types that grew every round")
            for _, kind, counts in sorted(grown, reverse=True)[:top]:
                print(f"    {kind[:70]:70s} {counts}")


def print_state_changes(snaps: list[dict[str, Any]]) -> None:
    """Per process, ferry's container sizes and counters that are not back to their value before
    the load (a request's entry left behind shows here)."""
    for proc in snaps[0].get("state", {}):
        series = [s.get("state", {}).get(proc, {}) for s in snaps]
        changed = []
        for key in sorted(set().union(*series)):
            values = [v.get(key, 0) for v in series]
            if values[-1] != values[0]:
                changed.append((key, values))
        if changed:
            print(f"{proc}: ferry state not back to its value before the load")
            for key, values in changed:
                print(f"    {key[:80]:80s} {values}")


def print_table(snaps: list[dict[str, Any]]) -> None:
    """One row per value, one column per snapshot (before the load, then after each round)."""
    rows = [flatten(s) for s in snaps]
    print(f"{'':58s}" + "".join(f"{'before' if i == 0 else f'round {i}':>13s}" for i in range(len(rows))))
    for key in rows[0]:
        print(f"{key[:58]:58s}" + "".join(f"{row.get(key, ''):>13}" for row in rows))


# ---------------------------------------------------------------- main


async def main_async(args: argparse.Namespace) -> int:
    from engine.demo import build_model

    work = Path(tempfile.mkdtemp(prefix="ferry-soak-"))
    model = build_model(work / MODEL)
    redis_proc = RedisProcess()
    tier = f"redis://127.0.0.1:{redis_proc.port}/0"
    ports = {"a": free_port(), "b": free_port(), "router": free_port()}
    py = [sys.executable, "-m", "ferry"]
    common = [
        "--model",
        str(model),
        "--num-threads",
        "1",
        "--kv-tier",
        tier,
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--num-kv-blocks",
        "256",
    ]
    procs: dict[str, Proc] = {}
    hook_dir = None
    if args.objects:
        hook_dir = work / "dumps"
        hook_dir.mkdir()
    logs = {n: work / f"{n}.log" for n in ports}
    try:
        procs["a"] = Proc(
            "a",
            [*py, "serve", *common, "--port", str(ports["a"]), "--api-server-count", "2"],
            logs["a"],
            hook_dir,
        )
        procs["b"] = Proc(
            "b",
            [
                *py,
                "serve",
                *common,
                "--port",
                str(ports["b"]),
                "--max-num-seqs",
                "4",
                "--max-queued-requests",
                "2",
            ],
            logs["b"],
            hook_dir,
        )
        await wait_healthy(ports["a"])
        await wait_healthy(ports["b"])
        procs["router"] = Proc(
            "router",
            [
                *py,
                "router",
                "--port",
                str(ports["router"]),
                "--policy",
                "least_load",
                "--replica",
                f"http://127.0.0.1:{ports['a']}",
                "--replica",
                f"http://127.0.0.1:{ports['b']}",
                "--max-concurrency",
                "10",
                "--max-queue",
                "2",
            ],
            logs["router"],
            hook_dir,
        )
        await wait_healthy(ports["router"])
        # A warm-up round, so that lazily built things (grammar compilers, pools) are in "before".
        warm = argparse.Namespace(**{**vars(args), "requests": 60, "seed": args.seed + 99})
        await run_load(warm, ports)
        await asyncio.sleep(args.settle)
        snaps = [await snapshot(procs, ports, redis_proc.port, hook_dir)]
        loads = []
        for r in range(args.rounds):
            loads.append(await run_load(argparse.Namespace(**{**vars(args), "seed": args.seed + r}), ports))
            await asyncio.sleep(args.settle)
            snaps.append(await snapshot(procs, ports, redis_proc.port, hook_dir))
        log_errors, stalls = scan_logs(logs)
        report = {
            "load": loads,
            "snapshots": snaps,
            "log_errors": log_errors,
            "engine_stalls": stalls,
            "logs": str(work),
        }
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1))
        print_table(snaps)
        if hook_dir is not None:
            print_object_growth(snaps)
            print_state_changes(snaps)
        print(
            json.dumps(
                {"load": loads, "log_errors": log_errors, "engine_stalls": stalls, "logs": str(work)},
                indent=1,
            )
        )
        problems = not_idle(snaps[0], snaps[-1]) + [
            f"{n}: {ln}" for n, b in report["log_errors"].items() for ln in b
        ]
        for problem in problems:
            print("NOT IDLE / LOGGED:", problem)
        return 1 if problems else 0
    finally:
        for proc in reversed(procs.values()):
            proc.stop()
        redis_proc.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=1500, help="requests per round")
    p.add_argument("--concurrency", type=int, default=12)
    p.add_argument("--rounds", type=int, default=2, help="rounds of --requests, a snapshot after each")
    p.add_argument("--settle", type=float, default=5.0, help="seconds to wait before each snapshot")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--objects",
        action="store_true",
        help="also count each process's live objects by type and its asyncio tasks (a signal hook)",
    )
    p.add_argument("--out", default=None, help="also write the report as JSON here")
    args = p.parse_args()
    if args.concurrency > 16:
        p.error("--concurrency is capped at 16 (a shared machine)")
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
