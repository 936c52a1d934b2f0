"""Embedding throughput: ferry ``LLM.embed`` (last-token pooling) vs transformers' base model in
padded batches, on the engine benchmark model (Llama shape, hidden 512, 8 layers, vocab 32000).

N inputs of 32..512 tokens (uniform, fixed seed). ferry: all inputs at once (chunked prefill,
continuous batching, no prefix cache). transformers: ``AutoModel`` forward in batches of 32, right
padding with an attention mask, the last real token's hidden state. Both vectors are compared
(max abs difference) so the speed is of the same result. Fastest of ``--repeats`` interleaved runs.

    .venv/bin/python bench/embeddings.py                 # 256 inputs
    .venv/bin/python bench/embeddings.py --num-inputs 32 # smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.engine_throughput import MODEL_SPEC, bench_model_dir  # noqa: E402


def inputs(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(3, MODEL_SPEC["vocab_size"]) for _ in range(rng.randint(32, 512))] for _ in range(n)
    ]


def run_ferry(path: Path, work: list[list[int]], threads: int) -> tuple[float, list[list[float]]]:
    from engine import LLM, PoolingParams

    llm = LLM(
        str(path),
        enable_prefix_caching=False,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        num_threads=threads,
    )
    raw = PoolingParams(normalize=False)  # the pooled states, as transformers' are compared
    llm.embed([work[0][:16]], pooling_params=raw)  # warm-up
    t0 = time.perf_counter()
    out = llm.embed(work, pooling_params=raw)
    return time.perf_counter() - t0, [o.outputs.embedding for o in out]


def run_hf(path: Path, work: list[list[int]], batch: int = 32) -> tuple[float, list[torch.Tensor]]:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    out: list[torch.Tensor] = []
    t0 = time.perf_counter()
    with torch.no_grad():
        for start in range(0, len(work), batch):
            chunk = work[start : start + batch]
            width = max(len(p) for p in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros(len(chunk), width, dtype=torch.long)
            for i, p in enumerate(chunk):
                ids[i, : len(p)] = torch.tensor(p)
                mask[i, : len(p)] = 1
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
            out += [hidden[i, len(p) - 1] for i, p in enumerate(chunk)]
    return time.perf_counter() - t0, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-inputs", type=int, default=256)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "embeddings.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = bench_model_dir()
    work = inputs(args.num_inputs)
    tokens = sum(len(p) for p in work)
    best: dict[str, float] = {}
    diff = 0.0
    for _ in range(max(1, args.repeats)):
        fs, fv = run_ferry(path, work, args.threads)
        hs, hv = run_hf(path, work)
        best["ferry"] = min(best.get("ferry", fs), fs)
        best["transformers"] = min(best.get("transformers", hs), hs)
        diff = max(float((torch.tensor(a) - b).abs().max()) for a, b in zip(fv, hv, strict=True))
    print(f"\nembeddings, {args.num_inputs} inputs ({tokens} tokens), {args.threads} threads")
    print(f"{'system':<14} {'seconds':>9} {'inputs/s':>10} {'tokens/s':>10}")
    for name, s in best.items():
        print(f"{name:<14} {s:>9.2f} {args.num_inputs / s:>10.1f} {tokens / s:>10.0f}")
    print(f"ferry / transformers: {best['transformers'] / best['ferry']:.2f}x; max |difference| {diff:.2e}")
    result = {
        "machine": {
            "threads": args.threads,
            "cpu": platform.processor() or platform.machine(),
            "torch": torch.__version__,
        },
        "num_inputs": args.num_inputs,
        "tokens": tokens,
        "seconds": best,
        "max_abs_difference": diff,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
