"""The shape of what `ferry bench` writes is a contract ("schema": "ferry-bench/1"): scripts,
dashboards and `--compare` of older results read these keys. A key renamed or dropped must come
with a new schema version, so this test pins them exactly."""

from __future__ import annotations

import json
from pathlib import Path

SUMMARY_KEYS = {
    "schema",
    "name",
    "created",
    "base_url",
    "model",
    "endpoint",
    "dataset",
    "burstiness",
    "warmup",
    "repeat",
    "slo_ms",
    "server_lost",
    "skipped_points",
    "points",
    "server_models",
    "environment",
    "interrupted",
}
DATASET_KEYS = {
    "name",
    "chains",
    "requests",
    "warmup_chains",
    "seed",
    "token_source",
    "requests_file",
    "requests_sha256",
}
POINT_KEYS = {"label", "concurrency", "request_rate", "metrics", "runs"}
RUN_KEYS = {"run", "repeat", "duration_s", "lost", "metrics"}
METRIC_KEYS = {
    "completed",
    "failed",
    "failures",
    "duration_s",
    "total_input_tokens",
    "total_output_tokens",
    "cached_prompt_tokens",
    "cached_prompt_fraction",
    "request_throughput",
    "input_throughput",
    "output_throughput",
    "total_token_throughput",
    "goodput",
    "good_requests",
    "slo_ms",
    "token_count_mismatches",
    "usage_missing",
    "ttft_ms",
    "tpot_ms",
    "itl_ms",
    "e2e_ms",
}
LATENCY_KEYS = {"count", "mean", "median", "p90", "p99", "std", "min", "max"}
RECORD_KEYS = {
    "run",
    "concurrency",
    "request_rate",
    "repeat",
    "chain",
    "index",
    "warmup",
    "session_id",
    "turn",
    "input_len",
    "output_len",
    "send_time_s",
    "ok",
    "error_kind",
    "error",
    "http_status",
    "ttft_s",
    "e2e_s",
    "itl_s",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "stream_chunks",
    "chunk_tokens",
    "usage_missing",
    "token_count_mismatch",
    "finish_reason",
    "tpot_s",
}


def test_summary_and_raw_records_keep_their_keys(standin, bench, tmp_path: Path) -> None:
    srv = standin("--tokens", "3")
    out = tmp_path / "r"
    flags = f"--base-url {srv.url} --num-prompts 3 --input-len 4 --output-len 3 --warmup 1 --concurrency 1,2"
    rc, stdout = bench(flags, "--slo", "ttft=60000,tpot=60000", "--output-dir", str(out))
    assert rc == 0, stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["schema"] == "ferry-bench/1"
    assert set(summary) == SUMMARY_KEYS
    assert set(summary["dataset"]) == DATASET_KEYS
    assert [p["label"] for p in summary["points"]] == ["c=1", "c=2"]
    for point in summary["points"]:
        assert set(point) == POINT_KEYS
        for run in point["runs"]:
            assert set(run) == RUN_KEYS
        for metrics in [point["metrics"], *(run["metrics"] for run in point["runs"])]:
            assert set(metrics) == METRIC_KEYS
            for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
                assert set(metrics[key]) == LATENCY_KEYS
            assert metrics["completed"] == 3 and metrics["good_requests"] == 3
            assert metrics["ttft_ms"]["count"] == 3 and metrics["itl_ms"]["count"] == 6
    records = [json.loads(line) for line in (out / "raw.jsonl").read_text().splitlines()]
    assert len(records) == 8  # 2 points x (1 warm-up + 3 measured)
    for rec in records:
        assert set(rec) == RECORD_KEYS
    assert sum(rec["warmup"] for rec in records) == 2
