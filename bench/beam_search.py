"""What a beam search costs the offline engine next to sampling the same number of choices.

Model: the Llama shape of ``bench/engine_throughput.py`` (hidden 512, 8 layers, vocab 32000,
random fp32 weights). Workload: N prompts (64..256 tokens), each answered with W choices of T tokens
(EOS ignored), all prompts at once; the prompts are computed once before timing (a warm prefix
cache), so the rows compare the generation that follows them. Rows, side by side in one run (interleaved repeats, the fastest
counts):

* ``sample_nW``: ``LLM.generate`` with ``n=W`` (seeded sampling): W sequences decoding together;
* ``beam_wW``: ``LLM.beam_search`` with ``beam_width=W``: each step submits every live beam as a
  one-token request (engine/beam_search.py), which finds the beam's full blocks in the prefix cache
  and copies its parent's last partial block (partial prefix caching), so it computes one token;
* ``beam_wW_no_partial``: the same with ``partial_prefix_caching=False``: each step also recomputes
  every beam's last partial block (up to ``block_size - 1`` tokens per beam);
* ``beam_wW_no_prefix_cache``: the same with prefix caching off (every step recomputes every beam
  from its first token): what the prefix cache saves the search.

Prints a table (seconds, output tokens per second, ratio to sampling, tokens the model computed)
and writes JSON to bench/results/beam_search.json.

    .venv/bin/python bench/beam_search.py                          # full run
    .venv/bin/python bench/beam_search.py --num-prompts 2 --max-tokens 8 --repeats 1   # smoke run
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


def workload(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(3, MODEL_SPEC["vocab_size"]) for _ in range(rng.randint(64, 256))] for _ in range(n)
    ]


def timed(fn) -> float:  # noqa: ANN001
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--widths", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--skip-no-prefix-cache",
        action="store_true",
        help="leave out the beam_wW_no_prefix_cache rows (the slowest by far)",
    )
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "beam_search.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from engine import LLM, BeamSearchParams, SamplingParams

    model_dir = bench_model_dir()
    prompts = workload(args.num_prompts)
    common = {"num_threads": args.threads, "max_num_seqs": 64, "num_kv_blocks": 4096}
    cached = LLM(str(model_dir), **common)
    whole_blocks = LLM(str(model_dir), partial_prefix_caching=False, **common)
    uncached = LLM(str(model_dir), enable_prefix_caching=False, **common)
    # Warm-up: first-call allocations, and every prompt computed once, so the rows compare what
    # follows the prompt (the prefix-cached rows find it cached; the uncached one recomputes it).
    for llm in (cached, whole_blocks, uncached):
        llm.beam_search([prompts[0][:32]], BeamSearchParams(beam_width=2, max_tokens=2, ignore_eos=True))
    for llm in (cached, whole_blocks):
        llm.generate(prompts, SamplingParams(max_tokens=1))
    t = args.max_tokens
    rows = {}
    for w in args.widths:
        beam = BeamSearchParams(beam_width=w, max_tokens=t, ignore_eos=True)
        sample = SamplingParams(n=w, temperature=1.0, seed=0, max_tokens=t, ignore_eos=True)
        rows[f"sample_n{w}"] = (w, cached, lambda s=sample: cached.generate(prompts, s))
        rows[f"beam_w{w}"] = (w, cached, lambda b=beam: cached.beam_search(prompts, b))
        rows[f"beam_w{w}_no_partial"] = (w, whole_blocks, lambda b=beam: whole_blocks.beam_search(prompts, b))
        if not args.skip_no_prefix_cache:
            rows[f"beam_w{w}_no_prefix_cache"] = (
                w,
                uncached,
                lambda b=beam: uncached.beam_search(prompts, b),
            )
    best: dict[str, dict] = {}
    for _ in range(args.repeats):
        for name, (w, llm, fn) in rows.items():
            before = llm.engine.iteration_tokens_sum
            seconds = timed(fn)
            tokens = w * t * len(prompts)
            if name not in best or seconds < best[name]["seconds"]:
                best[name] = {
                    "width": w,
                    "seconds": seconds,
                    "output_tokens": tokens,
                    "output_tok_s": tokens / seconds,
                    # tokens the model ran (all steps, all requests): what the prefix cache saves
                    "computed_tokens": llm.engine.iteration_tokens_sum - before,
                }
    print(f"{'configuration':<28} {'seconds':>8} {'output tok/s':>12} {'vs sampling':>11} {'computed':>9}")
    for name, r in best.items():
        r["vs_sampling"] = best[f"sample_n{r['width']}"]["seconds"] / r["seconds"]
        print(
            f"{name:<28} {r['seconds']:>8.2f} {r['output_tok_s']:>12.1f} {r['vs_sampling']:>11.3f}"
            f" {r['computed_tokens']:>9}"
        )
    save_report(
        args.out,
        args.threads,
        num_prompts=len(prompts),
        max_tokens=t,
        repeats=args.repeats,
        results=best,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
