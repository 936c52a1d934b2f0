"""What one long prompt costs the streams already running on a replica.

A `ferry serve` (tiny demo Llama by default) streams ``--streams`` greedy completions (``ignore_eos``,
``--max-tokens`` each); once they are under way, one client sends a completion whose prompt is
``--prompt-mb`` megabytes of text (past the model's context: the replica tokenizes it, then answers
400, as it must). While it is tokenized, the other streams' tokens stop unless the tokenization
leaves the event loop and the engine thread free. Per run: the longest gap between two tokens of
any running stream that spans the long prompt's request (its "stall"), the median gap of the
same streams (the normal pace), and how long the long request took to be answered.

``--base DIR`` serves the same from another checkout too (the code before a change), interleaved
run by run, so the two are compared on the same machine in the same minutes. The table prints the
median of ``--repeats`` runs per server; JSON goes to bench/results/long_prompt_stall.json.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.server_overhead import REPO, start_server, stop_servers, write_result

RESULTS = Path(__file__).resolve().parent / "results"


async def _stream(
    client: httpx.AsyncClient, url: str, model: str, max_tokens: int, stamps: list[float]
) -> None:
    body = {
        "model": model,
        "prompt": "Once upon a time",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())


async def one_run(url: str, model: str, args: argparse.Namespace) -> dict[str, float]:
    stamps: list[list[float]] = [[] for _ in range(args.streams)]
    long_prompt = "the quick brown fox jumps over the lazy dog " * int(args.prompt_mb * 1e6 / 44)
    async with httpx.AsyncClient(timeout=300) as client:
        streams = [asyncio.ensure_future(_stream(client, url, model, args.max_tokens, s)) for s in stamps]
        while min(len(s) for s in stamps) < 20:  # every stream under way
            await asyncio.sleep(0.01)
        sent = time.perf_counter()
        r = await client.post(
            url + "/v1/completions", json={"model": model, "prompt": long_prompt, "max_tokens": 4}
        )
        answered = time.perf_counter()
        if r.status_code != 400:
            raise RuntimeError(f"the long prompt got {r.status_code}, not the expected 400: {r.text[:200]}")
        await asyncio.gather(*streams)
    gaps, stall = [], 0.0
    for s in stamps:
        for a, b in zip(s, s[1:], strict=False):
            gaps.append(b - a)
            if a < answered and b > sent:  # a gap overlapping the long request
                stall = max(stall, b - a)
    return {"stall_s": stall, "median_gap_s": statistics.median(gaps), "answer_s": answered - sent}


async def run_all(servers: dict[str, str], model: str, args: argparse.Namespace) -> dict[str, list[dict]]:
    results: dict[str, list[dict]] = {name: [] for name in servers}
    for url in servers.values():  # warm up: one unrecorded run each
        await one_run(url, model, args)
    for _ in range(args.repeats):
        for name, url in servers.items():
            results[name].append(await one_run(url, model, args))
    return results


def print_table(results: dict[str, list[dict]]) -> list[dict]:
    rows = []
    print(f"{'server':<10} {'stall (ms)':>11} {'median gap (ms)':>16} {'long answer (ms)':>17}")
    for name, runs in results.items():
        row = {
            "server": name,
            "stall_ms": 1e3 * statistics.median(r["stall_s"] for r in runs),
            "median_gap_ms": 1e3 * statistics.median(r["median_gap_s"] for r in runs),
            "answer_ms": 1e3 * statistics.median(r["answer_s"] for r in runs),
        }
        rows.append(row)
        print(f"{name:<10} {row['stall_ms']:>11.0f} {row['median_gap_ms']:>16.1f} {row['answer_ms']:>17.0f}")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory (default: the demo model, built on first use)")
    p.add_argument("--base", type=Path, help="another checkout to serve the same from, for an A/B")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=300)
    p.add_argument("--prompt-mb", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS / "long_prompt_stall.json")
    args = p.parse_args(argv)
    model = args.model
    if model is None:
        from engine.demo import build_model

        model = str(build_model(Path(tempfile.gettempdir()) / "ferry-long-prompt-model"))
    logs = Path(tempfile.mkdtemp(prefix="ferry-long-prompt-"))
    opts = {"num_kv_blocks": 1024, "max_num_seqs": 16}
    repos = {"this": REPO} | ({"base": args.base.resolve()} if args.base else {})
    procs, servers = [], {}
    try:
        for name, repo in repos.items():
            proc, url = start_server(model, opts, logs / f"{name}.log", repo=repo)
            procs.append(proc)
            servers[name] = url
        served = httpx.get(next(iter(servers.values())) + "/v1/models", timeout=10).json()["data"][0]["id"]
        results = asyncio.run(run_all(servers, served, args))
    finally:
        stop_servers(procs)
    rows = print_table(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.base = str(args.base) if args.base else None
    args.out = str(args.out)
    write_result(Path(args.out), args, rows=rows, runs=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
