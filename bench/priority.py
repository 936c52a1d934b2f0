"""What ``--scheduling-policy priority`` buys interactive requests behind a batch backlog.

Model: the Llama shape of ``bench/engine_throughput.py`` (hidden 512, 8 layers, random fp32).

Workload, driven step by step through the offline engine (no HTTP, so only scheduling differs):
a backlog of ``--backlog`` batch requests (prompts 64..256 tokens, ``--batch-tokens`` output
tokens each, EOS ignored) is queued at once, more than ``--max-num-seqs`` can run; then, every
``--every`` engine steps, one interactive request arrives (a 32..96-token prompt, 16 output tokens)
until ``--interactive`` have arrived. Rows, side by side in one run (interleaved repeats, medians):

* ``fcfs``: every request priority 0 (arrival order);
* ``priority``: interactive requests priority -1, batch requests 0 (``scheduling_policy="priority"``:
  an interactive request is admitted ahead of the waiting backlog and may preempt a running batch
  request for its slot).

Reported: the interactive requests' TTFT (p50 / p90, from arrival to first token, in engine steps
and in milliseconds), the batch requests' completion time, total output tokens/s and preemptions.
Prints a table, writes JSON to bench/results/priority.json.

    .venv/bin/python bench/priority.py                        # full run
    .venv/bin/python bench/priority.py --backlog 16 --interactive 4 --repeats 1   # smoke run
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.engine_throughput import MODEL_SPEC, bench_model_dir, save_report  # noqa: E402


def workload(args: argparse.Namespace, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(seed)
    vocab = MODEL_SPEC["vocab_size"]

    def prompt(lo: int, hi: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))]

    return [prompt(64, 256) for _ in range(args.backlog)], [prompt(32, 96) for _ in range(args.interactive)]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(model_dir: Path, batch: list[list[int]], interactive: list[list[int]], policy: str, args) -> dict:
    from engine import LLM, SamplingParams

    llm = LLM(
        str(model_dir),
        enable_prefix_caching=False,
        num_threads=args.threads,
        max_num_seqs=args.max_num_seqs,
        num_kv_blocks=4096,
        scheduling_policy=policy,
    )
    engine = llm.engine
    llm.generate([batch[0][:16]], SamplingParams(max_tokens=2))  # warm up
    urgent = -1 if policy == "priority" else 0
    batch_params = SamplingParams(temperature=0.0, max_tokens=args.batch_tokens, ignore_eos=True)
    chat_params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for i, p in enumerate(batch):
        engine.add_request(engine.make_request(f"batch-{i}", p, batch_params))
    arrived: dict[str, tuple[int, float]] = {}  # interactive id -> (step, time) of arrival
    first: dict[str, tuple[int, float]] = {}
    finished: dict[str, float] = {}
    produced, step, next_arrival = 0, 0, 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests() or next_arrival < len(interactive):
        if next_arrival < len(interactive) and step >= (next_arrival + 1) * args.every:
            rid = f"chat-{next_arrival}"
            req = engine.make_request(rid, interactive[next_arrival], chat_params, priority=urgent)
            engine.add_request(req)
            arrived[rid] = (step, time.perf_counter())
            next_arrival += 1
        for out in engine.step():
            produced += len(out.outputs[0].token_ids) if out.outputs else 0
            rid = out.request_id
            if rid in arrived and rid not in first and out.outputs and out.outputs[0].token_ids:
                first[rid] = (step, time.perf_counter())
            if out.finished:
                finished[rid] = time.perf_counter() - t0
        step += 1
    seconds = time.perf_counter() - t0
    ttft_steps = [first[r][0] - arrived[r][0] + 1 for r in arrived]
    ttft_ms = [(first[r][1] - arrived[r][1]) * 1000 for r in arrived]
    batch_done = [finished[f"batch-{i}"] for i in range(len(batch))]
    result = {
        "ttft_steps_p50": pct(ttft_steps, 0.5),
        "ttft_steps_p90": pct(ttft_steps, 0.9),
        "ttft_ms_p50": pct(ttft_ms, 0.5),
        "ttft_ms_p90": pct(ttft_ms, 0.9),
        "batch_done_s_p50": pct(batch_done, 0.5),
        "batch_done_s_max": max(batch_done),
        "output_tok_s": produced / seconds,
        "preemptions": engine.scheduler.num_preemptions,
        "steps": step,
    }
    llm.close()
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backlog", type=int, default=48)
    ap.add_argument("--batch-tokens", type=int, default=64)
    ap.add_argument("--interactive", type=int, default=12)
    ap.add_argument("--every", type=int, default=20, help="engine steps between interactive arrivals")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "priority.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = bench_model_dir()
    batch, interactive = workload(args)
    runs: dict[str, list[dict]] = {"fcfs": [], "priority": []}
    for _ in range(args.repeats):
        for policy in runs:
            runs[policy].append(run(model_dir, batch, interactive, policy, args))
    summary = {p: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for p, rs in runs.items()}
    cols = [
        "ttft_steps_p50",
        "ttft_steps_p90",
        "ttft_ms_p50",
        "ttft_ms_p90",
        "batch_done_s_max",
        "output_tok_s",
        "preemptions",
    ]
    print(f"{'policy':<9}" + "".join(f"{c:>18}" for c in cols))
    for policy, s in summary.items():
        print(f"{policy:<9}" + "".join(f"{s[c]:>18.1f}" for c in cols))
    f, p = summary["fcfs"], summary["priority"]
    print(
        f"interactive TTFT p50: {f['ttft_ms_p50'] / max(p['ttft_ms_p50'], 1e-9):.1f}x lower with priority; "
        f"throughput ratio priority/fcfs {p['output_tok_s'] / f['output_tok_s']:.2f}"
    )
    save_report(args.out, args.threads, args=vars(args), median=summary, runs=runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
