"""What waiting for a prompt block being computed buys: n > 1 choices of long prompts, with the
scheduler's shared-prefix wait on (the default) and off, side by side, alternated ``--repeats``
times on the engine benchmark model.

With the wait off, choices of one prompt admitted in the same step each compute the prompt; with
it on, the first computes it and the others load its blocks from the prefix cache once they are
full. Prints a table, writes JSON.

    .venv/bin/python bench/shared_prefix.py [--prompts 4 --prompt-len 1024 --n 8 --max-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def run(wait: bool, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    from bench.engine_throughput import bench_model_dir
    from engine import LLM, SamplingParams

    llm = LLM(str(bench_model_dir()), max_num_seqs=64, num_threads=args.threads)
    if not wait:
        llm.engine.scheduler._waits_for_pending = lambda req, pending: False  # type: ignore[method-assign]
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=2))  # warm-up
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=args.max_tokens, n=args.n, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    stats = llm.engine.stats()
    llm.close()
    out_tokens = len(prompts) * args.n * args.max_tokens
    return {
        "seconds": seconds,
        "tokens_per_s": out_tokens / seconds,
        "prefix_cache_hits": stats.prefix_cache_hits,
        "prefix_cache_queries": stats.prefix_cache_queries,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "shared_prefix.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 32000) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    best: dict[str, dict] = {}
    for _ in range(args.repeats):
        for name, wait in (("wait off", False), ("wait on", True)):
            r = run(wait, prompts, args)
            if name not in best or r["seconds"] < best[name]["seconds"]:
                best[name] = r
    print(f"\n{args.prompts} prompts x {args.prompt_len} tokens, n={args.n}, {args.max_tokens} tokens each")
    print(f"{'scheduler':<10} {'seconds':>8} {'out tok/s':>10} {'prefix hits / prompt tokens':>28}")
    for name, r in best.items():
        hits = f"{r['prefix_cache_hits']:,} / {r['prefix_cache_queries']:,}"
        print(f"{name:<10} {r['seconds']:>8.2f} {r['tokens_per_s']:>10.1f} {hits:>28}")
    print(f"speed-up {best['wait off']['seconds'] / best['wait on']['seconds']:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": best}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
