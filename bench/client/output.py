"""The files of a results directory and how they are written.

* ``requests.jsonl``: the request set, one body a line (warm-up first); replay it with
  ``--dataset jsonl --dataset-path requests.jsonl``.
* ``raw.jsonl``: one record per request per run (warm-up included, flagged), written as runs end.
* ``summary.json``: config, environment, and per sweep point the pooled metrics plus each run's.
* ``summary.txt``: the terminal table. ``environment.json``: the environment alone.
"""

from __future__ import annotations

import hashlib
import json
import math
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench.client.config import BenchConfig, LoadPoint
from bench.client.load import RunResult
from bench.client.metrics import compute_metrics
from bench.client.types import Chain

SCHEMA = "ferry-bench/1"


def default_output_dir() -> Path:
    return Path("bench/results") / datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def write_requests(out_dir: Path, chains: list[Chain]) -> str:
    """Write requests.jsonl; return its sha256."""
    data = "".join(_dumps(req.to_line()) + "\n" for chain in chains for req in chain).encode()
    (out_dir / "requests.jsonl").write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def append_raw(out_dir: Path, result: RunResult) -> None:
    with (out_dir / "raw.jsonl").open("a", encoding="utf-8") as f:
        for rec in result.records:
            f.write(_dumps(rec.to_json()) + "\n")


def _rate(point: LoadPoint) -> float | None:
    return None if math.isinf(point.request_rate) else point.request_rate


def point_summary(point: LoadPoint, results: list[RunResult], slo_ms: dict[str, float]) -> dict[str, Any]:
    """Pooled metrics over the point's runs (latencies over all records, throughput over the summed
    measured durations) and each run's own metrics."""
    pooled = compute_metrics(
        [r for res in results for r in res.records], sum(res.duration_s for res in results), slo_ms
    )
    runs = [
        {
            "run": res.run,
            "repeat": res.repeat,
            "duration_s": res.duration_s,
            "lost": res.lost,
            "metrics": compute_metrics(res.records, res.duration_s, slo_ms).to_json(),
        }
        for res in results
    ]
    return {
        "label": point.label,
        "concurrency": point.concurrency,
        "request_rate": _rate(point),
        "metrics": pooled.to_json(),
        "runs": runs,
    }


def build_summary(
    cfg: BenchConfig,
    name: str,
    model: str,
    endpoint: str,
    models_response: Any,
    dataset: dict[str, Any],
    environment: dict[str, Any],
    points: list[dict[str, Any]],
    skipped: list[str],
    lost: str | None,
) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "name": name,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "base_url": cfg.base_url,
        "model": model,
        "endpoint": endpoint,
        "dataset": dataset,
        "burstiness": cfg.burstiness,
        "warmup": cfg.warmup,
        "repeat": cfg.repeat,
        "slo_ms": cfg.slo,
        "server_lost": lost,
        "skipped_points": skipped,
        "points": points,
        "server_models": models_response,
        "environment": environment,
    }


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
