"""Where a burst's time goes: waves of concurrent streamed requests through `ferry serve`, traced
across its processes, beside the same waves in process.

`bench/server_overhead.py` says how much HTTP adds to TTFT; this says where. Every process of each
replica (and this one, for the in-process mode) records timestamps through
``bench/trace_hook/burst_events.py`` (CLOCK_MONOTONIC, one clock for the machine), and each wave
is cut into phases, in ms from its first request's send:

* ``sends``: the client's last send (one event loop writes all of them);
* ``parsed``: the last request reaching the app (``EdgeMiddleware``);
* ``taken in``: the engine's last ``start`` (the engine process's, behind API servers);
* ``gathered``: the engine thread's burst gathering done; ``step``: its first step starting;
* ``step ms``: that step's length (it varies from wave to wave on a GPU box, more than the whole
  server overhead: ``TTFT - step`` takes it out);
* ``back``: the median request's first token at the client after the step ended;
* ``TTFT``: the wave's TTFT p50 (each request from its own send).

Modes, interleaved wave by wave: ``in-process`` (``AsyncEngine.generate`` here), ``N`` (a replica
with N API server processes; 1: one process), ``base/N`` (the same from the checkout at
``--base``, e.g. ``git worktree add /tmp/base HEAD~1``: an A/B in one run). Per mode the medians
over the waves print as a table; every wave's phases go to ``--out`` (JSON) and the raw events stay
under ``--trace-dir``.

Example (a GPU box): ``python -m bench.burst_trace --modes in-process 4 base/4 --base /tmp/base
--device cuda --dtype bfloat16 --num-threads 4``.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HOOK = REPO / "bench" / "trace_hook"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.server_overhead import (  # noqa: E402
    _free_port,
    _sse_events,
    bench_model_dir,
    make_prompts,
    stop_servers,
    wait_serving,
)

PHASES = ("sends", "parsed", "taken_in", "gathered", "step", "step_ms", "back", "ttft", "ttft_minus_step")


def _engine_flags(args: argparse.Namespace) -> list[str]:
    return [
        "--device", args.device, "--dtype", args.dtype, "--num-threads", str(args.num_threads),
        "--num-kv-blocks", str(args.num_kv_blocks), "--max-num-seqs", str(args.concurrency),
    ]  # fmt: skip


def start_replica(model: str, count: int, tree: Path, trace_dir: Path, args: argparse.Namespace):
    """`ferry serve` from ``tree`` with the trace hook in every process; (process, port)."""
    port = _free_port()
    env = {
        **os.environ,
        "FERRY_TRACE_DIR": str(trace_dir),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(HOOK), str(tree), os.environ.get("PYTHONPATH")])),
    }
    cmd = [
        sys.executable, "-m", "ferry", "serve", "--model", model, "--port", str(port),
        "--log-level", "warning", "--max-queued-requests", "100000",
        "--api-server-count", str(count), *_engine_flags(args),
    ]  # fmt: skip
    log = open(trace_dir / "server.log", "w")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)
    wait_serving(proc, f"http://127.0.0.1:{port}", trace_dir / "server.log")
    return proc, port


def http_runner(port: int, max_tokens: int):
    """``one(request_id, prompt, record)``: a streamed completion on a pooled keep-alive connection;
    records (send, first token) in monotonic ns."""
    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def one(rid: str, prompt: list[int], record: dict) -> None:
        body = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        # every token makes a chunk (a token that ends inside a character would make none)
        body = json.dumps({**body, "stream_options": {"continuous_usage_stats": True}}).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
            f"X-Request-Id: {rid}\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        conn = idle.pop() if idle else await asyncio.open_connection("127.0.0.1", port)
        reader, writer = conn
        sent = time.monotonic_ns()
        writer.write(head + body)
        status = await reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"HTTP error: {status!r}")
        while (await reader.readline()) not in (b"\r\n", b""):
            pass
        first = None
        async for payload, _ in _sse_events(reader):  # stamped here, on the traces' clock
            if first is None and payload != b"[DONE]":
                first = time.monotonic_ns()
        idle.append(conn)
        record[rid] = (sent, first)

    return one


def in_process_runner(engine, max_tokens: int):
    from engine import SamplingParams

    async def one(rid: str, prompt: list[int], record: dict) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        sent, first = time.monotonic_ns(), None
        async for out in engine.generate(rid, prompt, params):
            if first is None and out.outputs[0].token_ids:
                first = time.monotonic_ns()
        record[rid] = (sent, first)

    return one


def _base_id(engine_id: str) -> str:
    """The client's X-Request-Id from an engine request id (``<id>-<choice>[@<api server>]``)."""
    return engine_id.split("@")[0].rsplit("-", 1)[0]


def phases(record: dict[str, tuple[int, int]], events: list[list]) -> dict[str, float | None]:
    """One wave's phases (ms from its first send) from its requests' (send, first token) and the
    events of its replica (or of this process)."""
    t0 = min(s for s, _ in record.values())
    t_end = max(f for _, f in record.values())
    ids = set(record)
    wave = [e for e in events if t0 - 1_000_000 <= e[0] <= t_end]

    def ms(t: int) -> float:
        return (t - t0) / 1e6

    def first(name: str, after: int | None = None) -> int | None:
        return next((e[0] for e in wave if e[3] == name and (after is None or e[0] >= after)), None)

    parsed = [e[0] for e in wave if e[3] == "edge_in" and e[4][0] in ids]
    taken = [e[0] for e in wave if e[3] == "started" and _base_id(e[4][0]) in ids]
    # The wave's step is the first after its burst was gathered: the previous wave's last step
    # (its requests' later tokens) may still run as this wave's first requests arrive.
    gathered = first("gather_out")
    step_in = first("step_in", gathered)
    step_out = first("step_out", step_in)
    firsts = [f for _, f in record.values()]
    ttft = statistics.median((f - s) / 1e6 for s, f in record.values())
    step_ms = (step_out - step_in) / 1e6 if step_in and step_out else None
    return {
        "sends": ms(max(s for s, _ in record.values())),
        "parsed": ms(max(parsed)) if parsed else None,
        "taken_in": ms(max(taken)) if taken else None,
        "gathered": ms(gathered) if gathered else None,
        "step": ms(step_in) if step_in else None,
        "step_ms": step_ms,
        "back": (statistics.median(firsts) - step_out) / 1e6 if step_out else None,
        "ttft": ttft,
        "ttft_minus_step": ttft - step_ms if step_ms is not None else None,
    }


def read_events(directory: Path) -> list[list]:
    return sorted(json.loads(line) for f in glob.glob(str(directory / "trace-*.jsonl")) for line in open(f))


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def print_table(results: dict[str, list[dict]]) -> None:
    print(f"{'mode':>12} " + " ".join(f"{p:>9}" for p in ("sends", "parsed", "taken in", "gathered")), end="")
    print(" " + " ".join(f"{p:>9}" for p in ("step", "step ms", "back", "TTFT", "TTFT-step")) + "  (ms)")
    for mode, rows in results.items():
        cells = [_median([r[p] for r in rows]) for p in PHASES]
        print(f"{mode:>12} " + " ".join("        -" if c is None else f"{c:9.2f}" for c in cells))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", nargs="+", default=["in-process", "1", "4"])
    p.add_argument("--base", default=None, help="the checkout the base/N modes run from")
    p.add_argument("--model", default=None, help="model dir (default: the engine benchmark model)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--waves", type=int, default=8, help="recorded waves per mode (after 2 unrecorded)")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--num-kv-blocks", type=int, default=2048)
    p.add_argument("--trace-dir", default=None, help="where the events go (default: a new temp dir)")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "burst_trace.json"))
    args = p.parse_args(argv)
    if any(m.startswith("base/") for m in args.modes) and not args.base:
        p.error("base/N modes need --base")

    trace_root = Path(args.trace_dir or tempfile.mkdtemp(prefix="ferry-burst-trace-"))
    dirs = {m: trace_root / m.replace("/", "_") for m in args.modes}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
        for f in glob.glob(str(d / "trace-*.jsonl")):
            os.remove(f)
    if "in-process" in args.modes:
        sys.path.insert(0, str(HOOK))
        import burst_events

        burst_events.install(str(dirs["in-process"]))  # before the engine's modules are imported

    model = args.model or str(bench_model_dir())
    from engine.tokenizer import Tokenizer

    prompts = make_prompts(args.concurrency, args.prompt_len, Tokenizer.from_dir(model).vocab_size)
    replicas = {}
    try:
        for mode in args.modes:
            if mode != "in-process":
                tree = Path(args.base) if mode.startswith("base/") else REPO
                count = int(mode.removeprefix("base/"))
                replicas[mode] = start_replica(model, count, tree, dirs[mode], args)
        records = asyncio.run(_drive(model, replicas, prompts, args))
    finally:
        time.sleep(1.2)  # the hooks write every 0.5 s
        stop_servers([proc for proc, _ in replicas.values()])
    time.sleep(0.6)
    results = {}
    for mode in args.modes:
        events = read_events(dirs[mode])
        results[mode] = [phases(record, events) for record in records[mode]]
    print_table(results)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "trace_dir": str(trace_root), "waves": results}, indent=1))
    print(f"wrote {out}; events under {trace_root}")
    return 0


async def _drive(model: str, replicas: dict, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    runners = {}
    engine = None
    if "in-process" in args.modes:
        from engine import AsyncEngine

        engine = AsyncEngine(
            model=model,
            device=args.device,
            dtype=args.dtype,
            num_threads=args.num_threads,
            num_kv_blocks=args.num_kv_blocks,
            max_num_seqs=args.concurrency,
        )
    try:
        for mode in args.modes:
            runners[mode] = (
                in_process_runner(engine, args.max_tokens)
                if mode == "in-process"
                else http_runner(replicas[mode][1], args.max_tokens)
            )
        records: dict[str, list[dict]] = {m: [] for m in args.modes}
        for wave in range(args.waves + 2):  # the first two: allocations, connections
            for k, (mode, one) in enumerate(runners.items()):
                record: dict = {}
                await asyncio.gather(*(one(f"m{k}w{wave}x{i}", p, record) for i, p in enumerate(prompts)))
                if wave >= 2:
                    records[mode].append(record)
                await asyncio.sleep(0.15)  # the wave's streams have closed everywhere
        return records
    finally:
        if engine is not None:
            await engine.shutdown()


if __name__ == "__main__":
    sys.exit(main())
