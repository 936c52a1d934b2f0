"""What serving LoRA adapters costs the offline engine: throughput with adapters vs the base model.

Model: the Llama shape of ``bench/engine_throughput.py`` (hidden 512, 8 layers, intermediate
1408, vocab 32000, random fp32 weights). Adapters: rank 16 on every projection (q, k, v, o, gate,
up, down), random A and B, built once into the cache directory.

Workload: N requests (prompts uniform 64..256 tokens, 64 output tokens each, EOS ignored), all
submitted at once; prefix caching off. Rows, side by side in one run (interleaved repeats, the
fastest counts):
* ``base``: the engine without ``enable_lora``;
* ``lora_enabled_unused``: ``enable_lora=True``, no request names an adapter (the cost of the
  switch alone);
* ``one_adapter``: every request runs the same adapter;
* ``four_adapters``: requests spread over 4 adapters, ``max_loras=4`` (one step runs all four);
* ``four_adapters_max1``: the same with ``max_loras=1`` (a step runs one adapter; the others wait).
Prints a table, writes JSON to bench/results/lora.json.

    .venv/bin/python bench/lora.py                        # full run
    .venv/bin/python bench/lora.py --num-requests 8 --repeats 1   # smoke run
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.engine_throughput import MODEL_SPEC, bench_model_dir, save_report  # noqa: E402

RANK = 16


def adapters(model_dir: Path, count: int) -> list[Path]:
    from engine.demo import build_lora_adapter

    out = []
    for i in range(count):
        path = model_dir.parent / f"{model_dir.name}-lora-r{RANK}-{i}"
        if not (path / "adapter_config.json").exists():
            build_lora_adapter(path, model_dir, seed=i, rank=RANK, alpha=2 * RANK, std=0.02)
        out.append(path)
    return out


def workload(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(3, MODEL_SPEC["vocab_size"]) for _ in range(rng.randint(64, 256))] for _ in range(n)
    ]


def run(model_dir: Path, prompts: list[list[int]], loras: list, max_tokens: int, **options) -> dict:
    from engine import LLM, SamplingParams

    llm = LLM(str(model_dir), enable_prefix_caching=False, **options)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    warm = [lo for lo in dict.fromkeys(loras)]  # each adapter read once before timing
    llm.generate([prompts[0][:16]] * len(warm), SamplingParams(max_tokens=2), lora_request=warm)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras)
    seconds = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": seconds, "output_tokens": produced, "output_tok_s": produced / seconds}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "lora.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from engine import LoRARequest

    model_dir = bench_model_dir()
    paths = adapters(model_dir, 4)
    reqs = [LoRARequest(f"lora{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    prompts = workload(args.num_requests)
    n = len(prompts)
    common = {"num_threads": args.threads, "max_num_seqs": 64, "num_kv_blocks": 2048}
    rows = {
        "base": ([None] * n, {}),
        "lora_enabled_unused": ([None] * n, {"enable_lora": True}),
        "one_adapter": ([reqs[0]] * n, {"enable_lora": True, "max_lora_rank": RANK}),
        "four_adapters": (
            [reqs[i % 4] for i in range(n)],
            {"enable_lora": True, "max_lora_rank": RANK, "max_loras": 4},
        ),
        "four_adapters_max1": (
            [reqs[i % 4] for i in range(n)],
            {"enable_lora": True, "max_lora_rank": RANK, "max_loras": 1, "max_cpu_loras": 4},
        ),
    }
    best: dict[str, dict] = {}
    for _ in range(args.repeats):
        for name, (loras, options) in rows.items():
            result = run(model_dir, prompts, loras, args.max_tokens, **common, **options)
            if name not in best or result["output_tok_s"] > best[name]["output_tok_s"]:
                best[name] = result
    base = best["base"]["output_tok_s"]
    print(f"{'configuration':<22} {'output tok/s':>12} {'vs base':>8} {'seconds':>8}")
    for name, r in best.items():
        r["vs_base"] = r["output_tok_s"] / base
        print(f"{name:<22} {r['output_tok_s']:>12.1f} {r['vs_base']:>8.3f} {r['seconds']:>8.2f}")
    save_report(
        args.out,
        args.threads,
        rank=RANK,
        num_requests=n,
        max_tokens=args.max_tokens,
        repeats=args.repeats,
        results=best,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
