"""What structured outputs cost: decode throughput with and without a grammar, and compile times.

Engine benchmark model (``bench/engine_throughput.py``: Llama hidden 512, 8 layers, vocabulary
32000, random fp32 weights), offline ``LLM.generate``, at each concurrency in ``--concurrency``:
``--concurrency`` short prompts, ``--max-tokens`` output tokens each (``min_tokens`` = max_tokens,
so every request makes exactly that many), greedy. Modes, interleaved ``--repeats`` times after one
unrecorded warm-up each:

* ``plain``: no constraint;
* ``json``: a JSON schema (an array of at least 100 objects with an integer, a boolean and an
  enum), so the grammar never completes within the budget and every token is masked;
* ``regex``: ``[a-z ]+`` (a cheap grammar state: the floor of the per-token mask cost).

Also the time to compile the schema the first time and again (cached), with the vocabulary table
built first (its own line). Prints a table, writes JSON to bench/results/structured_outputs.json.

    .venv/bin/python bench/structured_outputs.py
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SCHEMA = {
    "type": "array",
    "minItems": 100,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "ok": {"type": "boolean"},
            "tag": {"enum": ["alpha", "beta", "gamma"]},
        },
        "required": ["id", "ok", "tag"],
        "additionalProperties": False,
    },
}


def main(argv: list[str] | None = None) -> int:
    from bench.engine_throughput import bench_model_dir
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams, StructuredOutputsParams

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "structured_outputs.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    llm = LLM(str(bench_model_dir()), num_kv_blocks=2048, num_threads=args.threads)
    engine = llm.engine
    constraints = {
        "plain": None,
        "json": StructuredOutputsParams(json=SCHEMA),
        "regex": StructuredOutputsParams(regex="[a-z ]+"),
    }

    t0 = time.perf_counter()
    engine.grammars.compile(StructuredOutputsParams(regex="a"))  # builds the vocabulary table
    vocab_table_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.grammars.compile(constraints["json"])
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.grammars.compile(constraints["json"])
    cached_s = time.perf_counter() - t0

    def run(n: int, spec) -> float:
        prompts = [[10 + (i * 7 + j) % 900 for j in range(16)] for i in range(n)]
        params = SamplingParams(
            max_tokens=args.max_tokens, min_tokens=args.max_tokens, temperature=0.0, structured_outputs=spec
        )
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == args.max_tokens for o in outs)
        return n * args.max_tokens / wall

    rows = []
    for n in args.concurrency:
        for spec in constraints.values():
            run(n, spec)  # warm-up
        rates: dict[str, list[float]] = {name: [] for name in constraints}
        for _ in range(args.repeats):
            for name, spec in constraints.items():
                rates[name].append(run(n, spec))
        plain = statistics.median(rates["plain"])
        for name in constraints:
            rate = statistics.median(rates[name])
            rows.append(
                {
                    "concurrency": n,
                    "mode": name,
                    "tokens_per_s": round(rate, 1),
                    "vs_plain": round(rate / plain, 3),
                    "added_ms_per_step": round(1e3 * n * (1 / rate - 1 / plain), 3),
                    "runs": [round(r, 1) for r in rates[name]],
                }
            )
    llm.close()

    print(
        f"structured outputs, engine bench model, {args.max_tokens} tokens per request, {args.threads} threads"
    )
    print(
        f"vocabulary table {vocab_table_s * 1e3:.0f} ms; schema compile {compile_s * 1e3:.1f} ms, cached {cached_s * 1e6:.0f} us"
    )
    print(f"{'conc':>4} {'mode':>6} {'tok/s':>9} {'vs plain':>9} {'+ms/step':>9}")
    for r in rows:
        print(
            f"{r['concurrency']:>4} {r['mode']:>6} {r['tokens_per_s']:>9.1f} {r['vs_plain']:>9.3f} {r['added_ms_per_step']:>9.3f}"
        )
    result = {
        "machine": platform.processor() or platform.machine(),
        "threads": args.threads,
        "max_tokens": args.max_tokens,
        "vocab_table_ms": round(vocab_table_s * 1e3, 1),
        "compile_ms": round(compile_s * 1e3, 2),
        "compile_cached_us": round(cached_s * 1e6, 1),
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
