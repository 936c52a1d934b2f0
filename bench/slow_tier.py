"""A slow Redis and the engine: how long a burst of requests takes when the tier answers late.

Run: ``python bench/slow_tier.py [--latency 0,0.05,0.5] [--requests 30] [--repeats 3]``

It starts its own redis-server on a free loopback port and, in front of it, a TCP proxy that
delivers every reply ``latency`` seconds after Redis sent it (latency only: replies in flight
overlap, as on a long network path). For each latency it serves a burst of ``--requests``
distinct prompts (``--prompt-len`` tokens, none of them in the tier: only the admission lookups
and the background writes talk to Redis) with ``LLM.generate`` on a tiny Llama, and compares the
wall time with the same burst and no tier at all, in the same run. Before the tier's lookups ran
off the engine thread, each admission waited one round trip (30 requests at 0.5 s: 15.7 s).

Prints a table and writes JSON to ``bench/results/slow_tier.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis  # noqa: E402

from bench.local_redis import LatencyProxy, RedisProcess  # noqa: E402


def _burst(model: str, tier: str | None, prompts: list[list[int]], args: argparse.Namespace) -> float:
    from engine import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    options = {"kv_tier": tier} if tier else {}
    with LLM(model, block_size=16, max_num_seqs=args.requests, **options) as llm:
        llm.generate([[5, 6, 7] * 20], params)  # warm-up (and a first connection to the tier)
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == args.max_tokens for o in outs)
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--latency", default="0,0.05,0.5", help="comma-separated reply latencies (seconds)")
    p.add_argument("--requests", type=int, default=30, help="requests in the burst")
    p.add_argument("--prompt-len", type=int, default=96)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", type=Path, default=None, help="a model directory (default: a tiny Llama)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "slow_tier.json")
    args = p.parse_args()
    latencies = [float(x) for x in args.latency.split(",")]
    model = str(args.model) if args.model else None
    if model is None:
        from engine.demo import build_model

        model = str(build_model(Path(tempfile.mkdtemp(prefix="slow-tier-")) / "tiny"))
    redis_proc = RedisProcess()
    rows: list[dict[str, object]] = []
    try:
        for repeat in range(args.repeats):
            # Fresh prompts each repeat, so no run finds another's blocks in the tier.
            prompts = [
                [(97 * (repeat * args.requests + r) + 13 * i) % 900 + 10 for i in range(args.prompt_len)]
                for r in range(args.requests)
            ]
            base = _burst(model, None, prompts, args)
            rows.append({"repeat": repeat, "latency_s": None, "seconds": base})
            for lat in latencies:
                proxy = LatencyProxy(redis_proc.port, lat)
                try:
                    url = f"redis://127.0.0.1:{proxy.port}/0?timeout={max(2.0, 4 * lat)}"
                    seconds = _burst(model, url, prompts, args)
                finally:
                    proxy.close()
                rows.append({"repeat": repeat, "latency_s": lat, "seconds": seconds})
                redis.Redis(port=redis_proc.port).flushall()
    finally:
        redis_proc.stop()
    print(f"machine: {platform.machine()} {os.cpu_count()} CPUs, python {platform.python_version()}")
    print(
        f"burst of {args.requests} requests, {args.prompt_len}-token prompts, {args.max_tokens} tokens each"
    )
    print(f"{'tier':<24}{'median s':>10}{'vs no tier':>12}")
    base_med = statistics.median(r["seconds"] for r in rows if r["latency_s"] is None)
    summary = {"no tier": base_med}
    print(f"{'no tier':<24}{base_med:>10.3f}{1.0:>12.2f}")
    for lat in latencies:
        med = statistics.median(r["seconds"] for r in rows if r["latency_s"] == lat)
        summary[f"redis +{lat * 1000:.0f} ms"] = med
        print(f"{f'redis +{lat * 1000:.0f} ms':<24}{med:>10.3f}{med / base_med:>12.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows, "median_seconds": summary},
            indent=2,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
