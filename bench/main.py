"""`ferry bench`: build the request set, run it over the sweep, write and print the results.

Also the two offline modes: ``--compare`` (side-by-side summaries) and ``--report`` (plots + HTML).
Failures of individual requests are results, not errors: the run finishes and reports them. Exit
status: 0 when every planned run finished; 1 when the server was lost part-way and 130 when
interrupted (both still write the summary of what ran); 2 for bad flags, an unusable dataset, or
a server unreachable before any request.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

import httpx

from bench.client.config import BenchConfig, ConfigError
from bench.client.datasets import DatasetContext, build_dataset
from bench.client.environment import collect_environment
from bench.client.load import PointRunner, RunResult
from bench.client.output import (
    append_raw,
    build_summary,
    default_output_dir,
    point_summary,
    write_json,
    write_requests,
)
from bench.client.table import summary_table
from bench.client.tokens import TokenSourceError, make_token_source


class BenchError(RuntimeError):
    pass


def _headers(cfg: BenchConfig) -> dict[str, str]:
    headers = dict(cfg.headers)
    if cfg.api_key:
        headers.setdefault("Authorization", f"Bearer {cfg.api_key}")
    return headers


def _models(cfg: BenchConfig, headers: dict[str, str]) -> Any:
    """GET /v1/models, or None when the server does not answer it (with ``--model`` it is only
    recorded in the summary, so it is not waited for long). A server that cannot be connected to
    at all (nothing listening, no route to it) is an error either way: every request would fail."""
    timeout = 30.0 if cfg.model is None else 5.0
    try:
        resp = httpx.get(cfg.base_url + "/v1/models", headers=headers, timeout=timeout, trust_env=False)
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        raise BenchError(f"cannot connect to {cfg.base_url} ({exc}); is the server up?") from None
    except httpx.HTTPError as exc:
        if cfg.model is None:
            raise BenchError(
                f"cannot reach {cfg.base_url}/v1/models to find the model ({exc}); "
                f"is the server up? (or pass --model)"
            ) from None
        return None
    if resp.status_code != 200:
        if cfg.model is None:
            raise BenchError(f"GET {cfg.base_url}/v1/models answered {resp.status_code}; pass --model")
        return None
    try:
        return resp.json()
    except ValueError:  # e.g. a gateway's HTML page
        if cfg.model is None:
            raise BenchError(
                f"GET {cfg.base_url}/v1/models answered 200 without JSON; pass --model"
            ) from None
        return None


def _model_name(cfg: BenchConfig, models: Any) -> str:
    if cfg.model is not None:
        return cfg.model
    data = models.get("data") if isinstance(models, dict) else None
    if not data or not isinstance(data[0], dict) or "id" not in data[0]:
        raise BenchError(f"GET {cfg.base_url}/v1/models lists no model; pass --model")
    return str(data[0]["id"])


def run_bench(args: argparse.Namespace) -> int:
    from bench.client.compare import write_compare

    try:
        if args.compare:
            print(write_compare(args.compare, args.output_dir))
            return 0
        if args.report:
            from bench.client.report import write_report

            _need_matplotlib()
            print(f"report: {write_report(args.report, args.output_dir)}")
            return 0
        cfg = BenchConfig.from_args(args)
        return _run(cfg, args)
    except (ConfigError, BenchError, TokenSourceError, ValueError, OSError) as exc:
        print(f"ferry bench: error: {exc}", file=sys.stderr)
        return 2


def _need_matplotlib() -> None:
    """--report draws with matplotlib, an extra (``plots``) that a plain install lacks: say so
    instead of a traceback."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise BenchError(
            "--report draws its plots with matplotlib, which is not installed: "
            "pip install matplotlib (ferry's 'plots' extra)"
        ) from None


def _run(cfg: BenchConfig, args: argparse.Namespace) -> int:
    headers = _headers(cfg)
    models = _models(cfg, headers)
    model = _model_name(cfg, models)
    ctx = DatasetContext(
        cfg, model, lambda: make_token_source(cfg.tokenizer, cfg.base_url, model, cfg.model, headers)
    )
    chains = build_dataset(ctx)
    if len(chains) <= cfg.warmup:
        raise BenchError(f"the dataset has {len(chains)} requests, not more than --warmup {cfg.warmup}")
    out_dir = Path(cfg.output_dir) if cfg.output_dir else default_output_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "raw.jsonl").unlink(missing_ok=True)
    requests_sha = write_requests(out_dir, chains)
    source = ctx.source_description()
    dataset = {
        "name": cfg.dataset,
        "chains": len(chains),
        "requests": sum(map(len, chains)),
        "warmup_chains": cfg.warmup,
        "seed": cfg.seed,
        "token_source": source,
        "requests_file": "requests.jsonl",
        "requests_sha256": requests_sha,
    }
    if cfg.lora_modules:
        dataset["lora_modules"] = list(cfg.lora_modules)
    environment = collect_environment(vars(args), [cfg.model, cfg.tokenizer])
    write_json(out_dir / "environment.json", environment)
    if cfg.dry_run:
        print(f"dry run: {dataset['requests']} requests written to {out_dir / 'requests.jsonl'}")
        return 0

    results: list[RunResult] = []
    interrupted = False
    try:
        lost = asyncio.run(_sweep(cfg, chains, headers, out_dir, results))
    except KeyboardInterrupt:
        # Summarise the runs that finished; the interrupted one's records are incomplete.
        lost, interrupted = None, True
    points, skipped = [], []
    for point in cfg.points:
        runs = [r for r in results if r.point == point]
        if runs:
            points.append(point_summary(point, runs, cfg.slo))
        else:
            skipped.append(point.label)
    name = cfg.label or out_dir.resolve().name
    endpoints = ",".join(sorted({req.endpoint for chain in chains for req in chain}))
    summary = build_summary(cfg, name, model, endpoints, models, dataset, environment, points, skipped, lost)
    summary["interrupted"] = interrupted
    write_json(out_dir / "summary.json", summary)
    title = f"ferry bench: {cfg.dataset} on {cfg.base_url} ({model}, {summary['endpoint']})"
    table = summary_table(points, title) if points else title + "\n(no run finished)"
    if any(p["metrics"]["token_count_mismatches"] for p in points):
        table += (
            "\nnote: token count mismatch = usage's completion tokens != token chunks: the server sent "
            "several tokens in a chunk (or held text back); ITL is per chunk, TPOT per token."
        )
    if lost or interrupted:
        why = f"server lost: {lost}" if lost else "interrupted"
        table += f"\n{why}" + (f"; skipped points: {', '.join(skipped)}" if skipped else "")
    (out_dir / "summary.txt").write_text(table + "\n")
    print(table)
    print(f"results: {out_dir}")
    return 130 if interrupted else 1 if lost else 0


async def _sweep(
    cfg: BenchConfig, chains: list, headers: dict[str, str], out_dir: Path, results: list[RunResult]
) -> str | None:
    """Run every point x repeat, appending to ``results``; stop at a lost server (returns why)."""
    runner = PointRunner(cfg, chains, headers)
    run = 0
    for point in cfg.points:
        for repeat in range(cfg.repeat):
            result = await runner.run(run, point, repeat)
            run += 1
            results.append(result)
            append_raw(out_dir, result)
            if result.lost:
                return result.lost
    return None
