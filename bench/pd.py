"""Prefill/decode disaggregation vs colocated serving, behind ferry's router, same workload.

Two topologies on this machine, one after the other, each worker with one engine thread:

* ``pd``: router (``--pd-threshold`` so only long prompts are handed off) + 1 prefill worker +
  1 decode worker sharing a private Redis KV tier;
* ``colocated``: router + 2 mixed replicas.

Workload (identical request set for both, from ``--seed``): ``--steady`` closed-loop streams of
short prompts with long outputs (the decodes whose inter-token latency we protect), plus every
``--burst-every`` seconds a burst of ``--burst-size`` prompts of ``--burst-min``..``--burst-max``
tokens with short outputs. Prompts are token-id lists (exact lengths), outputs fixed
(``ignore_eos``). Reported per topology and per request class: TTFT p50/p99, ITL p50/p99, output
tokens/s and goodput under ``--slo``; JSON to ``bench/results/pd.json``.

Target (issue 6): steady ITL p99 with PD <= 1/2 of colocated at equal or better goodput.

    .venv/bin/python bench/pd.py                 # engine benchmark model (bench/engine_throughput.py)
    .venv/bin/python bench/pd.py --quick         # the small demo model, shorter run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.client.config import parse_slo  # noqa: E402
from bench.client.metrics import compute_metrics, percentile  # noqa: E402
from bench.client.request import send_request  # noqa: E402
from bench.client.types import RequestRecord  # noqa: E402
from bench.local_redis import RedisProcess, free_port  # noqa: E402


@dataclass
class Child:
    args: list[str]
    port: int
    log: Path
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Child:
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ferry", *self.args],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        return self

    def wait(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.args[0]} exited:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.url} not ready:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ----------------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class Planned:
    kind: str  # "steady" | "burst"
    at_s: float  # bursts: send time after the start; steady: 0 (closed loop)
    prompt: list[int]
    max_tokens: int


def plan(args: argparse.Namespace, vocab: int) -> tuple[list[list[Planned]], list[Planned]]:
    """(steady request queues, one per stream; burst requests). Token ids avoid the first 16
    ids (special tokens of the demo tokenizers)."""
    rng = random.Random(args.seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(16, vocab) for _ in range(n)]

    per_stream = max(1, int(args.duration * 20))  # more than a stream can use in the run
    steady = [
        [Planned("steady", 0.0, ids(args.steady_input), args.steady_output) for _ in range(per_stream)]
        for _ in range(args.steady)
    ]
    bursts = []
    t = args.burst_every / 2
    while t < args.duration:
        for _ in range(args.burst_size):
            n = rng.randint(args.burst_min, args.burst_max)
            bursts.append(Planned("burst", t, ids(n), args.burst_output))
        t += args.burst_every
    return steady, bursts


def _record(kind: str, index: int, p: Planned) -> RequestRecord:
    return RequestRecord(
        run=0,
        concurrency=None,
        request_rate=None,
        repeat=0,
        chain=0 if kind == "steady" else 1,
        index=index,
        warmup=False,
        session_id=None,
        turn=0,
        input_len=len(p.prompt),
        output_len=p.max_tokens,
    )


async def drive(
    base_url: str, args: argparse.Namespace, model: str, vocab: int
) -> tuple[dict[str, list[RequestRecord]], float]:
    """Run the workload; (records by class, wall seconds)."""
    steady, bursts = plan(args, vocab)
    records: dict[str, list[RequestRecord]] = {"steady": [], "burst": []}
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        start = time.perf_counter()
        end = start + args.duration

        async def one(p: Planned, index: int) -> None:
            rec = _record(p.kind, index, p)
            rec.send_time_s = time.perf_counter() - start
            body = {
                "model": model,
                "prompt": p.prompt,
                "max_tokens": p.max_tokens,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            await send_request(client, base_url, "completions", body, {}, rec, args.timeout)
            records[p.kind].append(rec)

        async def stream_loop(queue: list[Planned]) -> None:
            for i, p in enumerate(queue):
                if time.perf_counter() >= end:
                    return
                await one(p, i)

        async def burst_at(p: Planned, i: int) -> None:
            await asyncio.sleep(max(0.0, start + p.at_s - time.perf_counter()))
            await one(p, i)

        await asyncio.gather(
            *(stream_loop(q) for q in steady), *(burst_at(p, i) for i, p in enumerate(bursts))
        )
        wall = time.perf_counter() - start
    return records, wall


# ----------------------------------------------------------------------------------- topologies


def serve_args(model: Path, port: int, *extra: str) -> list[str]:
    return ["serve", "--model", str(model), "--port", str(port), "--num-threads", "1", "--deterministic",
            "--max-num-seqs", "32", *extra]  # fmt: skip


def topology(
    name: str, model: Path, tmp: Path, redis: RedisProcess | None, args: argparse.Namespace
) -> list[Child]:
    blocks = ("--num-kv-blocks", str(args.num_kv_blocks), *args.serve_args.split())
    if name == "pd":
        assert redis is not None
        tier = ("--kv-tier", redis.url)
        workers = [
            Child(serve_args(model, p, "--role", role, *tier, *blocks), p, tmp / f"{role}.log")
            for role, p in (("prefill", free_port()), ("decode", free_port()))
        ]
        flags = [
            "--prefill",
            workers[0].url,
            "--decode",
            workers[1].url,
            "--pd-threshold",
            str(args.pd_threshold),
        ]
    else:
        workers = [
            Child(serve_args(model, p, *blocks), p, tmp / f"mixed{i}.log")
            for i, p in enumerate((free_port(), free_port()))
        ]
        flags = [f for w in workers for f in ("--replica", w.url)]
    port = free_port()
    router = Child(
        ["router", "--port", str(port), "--model", str(model), *flags], port, tmp / f"router-{name}.log"
    )
    return [*workers, router]


def run_topology(name: str, model: Path, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix=f"ferry-bench-pd-{name}-"))
    redis = RedisProcess() if name == "pd" else None
    children = topology(name, model, tmp, redis, args)
    try:
        for c in children:
            c.start()
        for c in children:
            c.wait()
        served = httpx.get(children[-1].url + "/v1/models", timeout=10).json()["data"][0]["id"]
        # Warm-up: one request of each class (first-call costs stay out of the figures).
        warm = argparse.Namespace(**{**vars(args), "duration": 0.1, "steady": 1, "burst_size": 1})
        asyncio.run(drive(children[-1].url, warm, served, vocab))
        records, wall = asyncio.run(drive(children[-1].url, args, served, vocab))
        slo = parse_slo(args.slo)
        result: dict[str, Any] = {"wall_s": wall}
        every = [r for rs in records.values() for r in rs]
        for label, recs in (("all", every), *records.items()):
            result[label] = compute_metrics(recs, wall, slo).to_json()
            result[label]["itl_tail"] = itl_tail(recs, args.stall_ms)
        result["router_pd"] = _router_pd(children[-1].url)
        result["logs"] = str(tmp)
        return result
    finally:
        for c in reversed(children):
            c.stop()
        if redis is not None:
            redis.stop()


def itl_tail(records: list[RequestRecord], stall_ms: float) -> dict[str, float | None]:
    """The far tail of inter-token gaps: a long prefill batched with running decodes shows up as
    a few long gaps, which p99 misses when bursts are rare."""
    gaps = [g * 1000.0 for r in records if r.ok for g in r.itl_s]
    if not gaps:
        return {"p99_9_ms": None, "max_ms": None, "stall_fraction": None}
    return {
        "p99_9_ms": percentile(gaps, 99.9),
        "max_ms": max(gaps),
        "stall_fraction": sum(g > stall_ms for g in gaps) / len(gaps),
    }


def _router_pd(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(("ferry:router_pd_requests_total", "ferry:router_pd_local_prefill_total")):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _row(name: str, label: str, m: dict[str, Any]) -> str:
    tail = m["itl_tail"]

    def p(stats: dict[str, Any] | None, q: str) -> str:
        return f"{stats[q]:9.1f}" if stats and stats.get(q) is not None else f"{'-':>9}"

    return (
        f"{name:10} {label:7} {m['completed']:5d} {m['failed']:4d} {p(m.get('ttft_ms'), 'median')} {p(m.get('ttft_ms'), 'p99')} "
        f"{p(m.get('itl_ms'), 'median')} {p(m.get('itl_ms'), 'p99')} {m.get('output_throughput', 0):9.1f} "
        f"{m.get('goodput') or 0:8.3f} {tail['p99_9_ms'] or 0:9.1f} {tail['max_ms'] or 0:9.1f} "
        f"{100 * (tail['stall_fraction'] or 0):7.2f}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the small demo model and a short run")
    ap.add_argument("--model", default=None, help="model directory (default: the engine benchmark model)")
    ap.add_argument("--only", choices=["pd", "colocated"], default=None)
    ap.add_argument("--duration", type=float, default=None, help="seconds of load (default 60; --quick 20)")
    ap.add_argument("--steady", type=int, default=4, help="closed-loop streaming decodes")
    ap.add_argument("--steady-input", type=int, default=64)
    ap.add_argument("--steady-output", type=int, default=96)
    ap.add_argument("--burst-every", type=float, default=8.0)
    ap.add_argument("--burst-size", type=int, default=2)
    ap.add_argument("--burst-min", type=int, default=1024)
    ap.add_argument("--burst-max", type=int, default=2048 - 64)
    ap.add_argument("--burst-output", type=int, default=16)
    ap.add_argument(
        "--pd-threshold", type=int, default=256, help="router flag: shorter prompts prefill on decode"
    )
    ap.add_argument("--num-kv-blocks", type=int, default=1024)
    ap.add_argument(
        "--serve-args",
        default="",
        help="extra ferry serve flags for every worker, e.g. '--long-prefill-token-threshold 256'",
    )
    ap.add_argument("--slo", default="ttft=5000,tpot=200", help="goodput targets in ms")
    ap.add_argument(
        "--stall-ms", type=float, default=250.0, help="an inter-token gap longer than this is a stall"
    )
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "pd.json"))
    args = ap.parse_args(argv)
    if args.duration is None:
        args.duration = 20.0 if args.quick else 60.0
    if args.model:
        model = Path(args.model)
    elif args.quick:
        from engine.demo import demo_model_dir

        model = demo_model_dir()
    else:
        from bench.engine_throughput import bench_model_dir

        model = bench_model_dir()
    from engine.tokenizer import Tokenizer

    # Prompt ids within both the model's and the tokenizer's vocabulary (the engine checks both).
    tokenizer_vocab = Tokenizer.from_dir(model).backend.get_vocab_size()
    vocab = min(int(json.loads((model / "config.json").read_text())["vocab_size"]), tokenizer_vocab)
    names = [args.only] if args.only else ["colocated", "pd"]
    results = {name: run_topology(name, model, args, vocab) for name in names}

    print(f"{'topology':10} {'class':7} {'ok':>5} {'fail':>4} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'ITL p50':>9} {'ITL p99':>9} {'out tok/s':>9} {'goodput':>8} {'ITL p99.9':>9} {'ITL max':>9} {'stall%':>7}")  # fmt: skip
    for name, res in results.items():
        for label in ("all", "steady", "burst"):
            print(_row(name, label, res[label]))
    verdict: dict[str, Any] = {}
    if "pd" in results and "colocated" in results:
        pd_itl = (results["pd"]["steady"].get("itl_ms") or {}).get("p99")
        co_itl = (results["colocated"]["steady"].get("itl_ms") or {}).get("p99")
        pd_good = results["pd"]["all"].get("goodput") or 0.0
        co_good = results["colocated"]["all"].get("goodput") or 0.0
        if pd_itl and co_itl:
            verdict = {
                "steady_itl_p99_ratio_pd_over_colocated": pd_itl / co_itl,
                "goodput_ratio_pd_over_colocated": pd_good / co_good if co_good else None,
                "target_met": pd_itl <= co_itl / 2 and pd_good >= co_good,
            }
            print(
                f"steady ITL p99 PD/colocated = {verdict['steady_itl_p99_ratio_pd_over_colocated']:.2f} "
                f"(target <= 0.5), goodput ratio = {verdict['goodput_ratio_pd_over_colocated']}"
            )
    out = {
        "bench": "pd",
        "model": str(model),
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "machine": {"cpus": os.cpu_count(), "note": "shared machine: other processes disturb the figures"},
        "results": results,
        "verdict": verdict,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
