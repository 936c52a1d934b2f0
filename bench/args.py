"""`ferry bench` flags. Parsing only: values are checked and frozen in bench/client/config.py.

This module is imported by `ferry --help` and `ferry router`, so it imports nothing but argparse.
"""

from __future__ import annotations

import argparse
import os

DATASETS = ["random", "shared-prefix", "multi-turn", "jsonl", "sharegpt"]


def add_bench_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.description = (
        "Benchmark any OpenAI-compatible endpoint with streamed requests: TTFT, TPOT, ITL, E2E latency, "
        "throughput and goodput, over a concurrency / request-rate sweep. Also --compare and --report."
    )
    target = p.add_argument_group("target")
    target.add_argument("--base-url", default="http://127.0.0.1:8000", help="server or router URL")
    target.add_argument(
        "--model", default=None, help="model name to send (default: first id of GET /v1/models)"
    )
    target.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME",
        help="LoRA adapters the server serves: each request (each conversation, with multi-turn) names "
        "one of them as its model, chosen at random from --seed (as vLLM's benchmark)",
    )
    target.add_argument(
        "--endpoint",
        choices=["chat", "completions", "responses", "embeddings"],
        default=None,
        help="API to call (default: chat for multi-turn, completions otherwise; responses: OpenAI's "
        "Responses API, the prompt as one user message; embeddings: one input per request, timed "
        "to its answer)",
    )
    target.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token (default: $OPENAI_API_KEY)"
    )
    target.add_argument(
        "--header",
        action="append",
        default=[],
        metavar="NAME:VALUE",
        help="extra HTTP header on every request (repeatable)",
    )

    data = p.add_argument_group("dataset (reproducible from --seed)")
    data.add_argument("--dataset", choices=DATASETS, default="random")
    data.add_argument(
        "--dataset-path",
        default=None,
        help="jsonl: one OpenAI request body per line; sharegpt: a ShareGPT JSON file (a list of "
        "records with 'conversations'; JSON lines too)",
    )
    data.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="measured requests (multi-turn: sessions). Default: random 200, shared-prefix "
        "groups x prompts-per-group, multi-turn 8, jsonl every line, sharegpt 1000",
    )
    data.add_argument(
        "--input-len",
        type=int,
        default=256,
        help="prompt tokens (shared-prefix: suffix tokens; multi-turn: new tokens per turn)",
    )
    data.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="completion tokens (max_tokens); default 128. sharegpt: given, it replaces the recorded "
        "reply's length (as vLLM's --sharegpt-output-len)",
    )
    data.add_argument(
        "--range-ratio", type=float, default=0.0, help="lengths drawn uniformly from [len*(1-r), len*(1+r)]"
    )
    data.add_argument(
        "--prefix-len", type=int, default=256, help="shared-prefix: tokens of each shared prefix"
    )
    data.add_argument("--num-groups", type=int, default=4, help="shared-prefix: distinct prefixes")
    data.add_argument("--prompts-per-group", type=int, default=8, help="shared-prefix: suffixes per prefix")
    data.add_argument(
        "--turns",
        type=int,
        default=None,
        help="multi-turn: turns per session (default 4). sharegpt: given (> 1), replay up to this many "
        "human turns of each conversation as a session",
    )
    data.add_argument(
        "--sharegpt-max-input-len",
        type=int,
        default=1024,
        help="sharegpt: skip pairs whose prompt has more tokens (vLLM's filter)",
    )
    data.add_argument(
        "--sharegpt-max-total-len",
        type=int,
        default=2048,
        help="sharegpt: skip pairs whose prompt + output have more tokens (vLLM's filter)",
    )
    data.add_argument(
        "--tokenizer",
        default="auto",
        help="how prompts of a token length are built: a local HF directory (tokenizer.json), "
        "'server' (/tokenize, /detokenize), 'words' (a word ~ a token, approximate), "
        "or 'auto' (the --model directory if local, else server, else words)",
    )
    data.add_argument(
        "--token-ids",
        action="store_true",
        help="completions: send prompts as token-id lists, so input lengths are exact",
    )
    data.add_argument("--seed", type=int, default=0)

    req = p.add_argument_group("request shape")
    req.add_argument("--max-tokens", type=int, default=None, help="override max_tokens on every request")
    req.add_argument("--ignore-eos", action="store_true", help="send ignore_eos so output lengths are fixed")
    req.add_argument(
        "--continuous-usage-stats",
        action="store_true",
        help="ask for usage on every chunk (vLLM/ferry extension): exact tokens per chunk",
    )
    req.add_argument("--temperature", type=float, default=0.0)
    req.add_argument("--extra-body", default=None, help="JSON object merged into every request body")

    load = p.add_argument_group("load")
    load.add_argument(
        "--concurrency",
        default=None,
        help="max requests (multi-turn: sessions) in flight; a comma list is a sweep, e.g. 1,4,16,64",
    )
    load.add_argument(
        "--request-rate",
        default=None,
        help="arrivals per second (Poisson, or gamma with --burstiness); comma list sweeps; "
        "default inf (all at once, bounded by --concurrency)",
    )
    load.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of inter-arrival times: 1 = Poisson, <1 burstier, >1 steadier",
    )
    load.add_argument(
        "--warmup",
        type=int,
        default=0,
        help="requests (multi-turn: sessions) sent before each run and left out of the figures",
    )
    load.add_argument("--repeat", type=int, default=1, help="runs per sweep point")
    load.add_argument(
        "--reset-prefix-cache",
        action="store_true",
        help="POST /reset_prefix_cache before each run, so no run reuses an earlier run's cached prompts",
    )
    load.add_argument("--timeout", type=float, default=600.0, help="seconds for one whole request")
    load.add_argument(
        "--slo", default=None, help="goodput targets in ms, e.g. ttft=500,tpot=50 (keys: ttft, tpot, e2e)"
    )

    out = p.add_argument_group("output")
    out.add_argument("--label", default=None, help="name of this run in --compare tables and reports")
    out.add_argument("--output-dir", default=None, help="default: bench/results/<timestamp>")
    out.add_argument("--dry-run", action="store_true", help="build and save requests.jsonl, send nothing")
    out.add_argument("--no-progress", action="store_true", help="no progress line on stderr")

    other = p.add_argument_group("other modes (no requests sent)")
    other.add_argument(
        "--compare",
        nargs="+",
        default=None,
        metavar="SUMMARY_JSON",
        help="side-by-side table of summary.json files with ratios to the first",
    )
    other.add_argument(
        "--report",
        default=None,
        metavar="RESULTS_DIR",
        help="write PNG plots and report.html for a results directory",
    )
    return p
