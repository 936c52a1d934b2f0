"""What a KV tier costs a replica's prefill: TTFT of long distinct prompts through `ferry serve`
with and without ``--kv-tier memory://``.

Every prompt is new (no prefix-cache or tier hit), so the two should compute the same: a tier
should only add its writes, which run on their own thread. Each server gets ``--repeats`` prompts
of ``--prompt-len`` token ids (``max_tokens`` 1), after one warm-up prompt; servers take turns
prompt by prompt, so they are compared in the same minutes. ``--base DIR`` serves the tier row
from another checkout too (the code before a change). Engine bench model by default
(bench/engine_throughput.py: Llama hidden 512, 8 layers, fp32). JSON to
bench/results/tier_prefill.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.server_overhead import REPO, bench_model_dir, start_server, stop_servers, write_result  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def ttft(url: str, model: str, prompt: list[int]) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    start = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory (default: the engine bench model)")
    p.add_argument("--base", type=Path, help="another checkout to serve the tier row from too, for an A/B")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS / "tier_prefill.json")
    args = p.parse_args(argv)
    model = args.model or str(bench_model_dir())
    logs = Path(tempfile.mkdtemp(prefix="ferry-tier-prefill-"))
    opts = {"num_threads": args.num_threads, "max_num_batched_tokens": max(2048, args.prompt_len)}
    rows = [("no tier", REPO, {}), ("memory tier", REPO, {"kv_tier": "memory://"})]
    if args.base:
        rows.append(("memory tier, base", args.base.resolve(), {"kv_tier": "memory://"}))
    procs, servers = [], {}
    try:
        for name, repo, extra in rows:
            proc, url = start_server(model, opts | extra, logs / f"{len(procs)}.log", repo=repo)
            procs.append(proc)
            servers[name] = url
        served = httpx.get(servers["no tier"] + "/v1/models", timeout=10).json()["data"][0]["id"]
        times: dict[str, list[float]] = {name: [] for name in servers}
        for rep in range(args.repeats + 1):
            for i, (name, url) in enumerate(servers.items()):
                seed = rep * len(servers) + i + 1
                prompt = [(seed * 7919 + 31 * t) % 900 + 10 for t in range(args.prompt_len)]
                took = ttft(url, served, prompt)
                if rep:  # the first round warms up
                    times[name].append(took)
    finally:
        stop_servers(procs)
    base = statistics.median(times["no tier"])
    table = []
    print(f"\nTTFT of a {args.prompt_len}-token prompt, median of {args.repeats}")
    for name, runs in times.items():
        median = statistics.median(runs)
        table.append({"server": name, "ttft_s": median, "vs_no_tier": median / base})
        print(f"  {name:<18} {median * 1000:8.1f} ms  {median / base:5.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.base = str(args.base) if args.base else None
    args.out = str(args.out)
    write_result(Path(args.out), args, rows=table, runs=times)
    return 0


if __name__ == "__main__":
    sys.exit(main())
