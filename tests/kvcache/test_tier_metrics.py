"""The tier's Prometheus series are exposed under exactly the documented names."""

from __future__ import annotations

import subprocess
import sys

from prometheus_client import REGISTRY, generate_latest

import kvcache.metrics  # noqa: F401  (registers the collectors)
from kvcache.tier import open_tier

EXPECTED = [
    "ferry:kv_tier_hits_total",
    "ferry:kv_tier_misses_total",
    "ferry:kv_tier_bytes_read_total",
    "ferry:kv_tier_bytes_written_total",
    'ferry:kv_tier_errors_total{kind="corrupt"}',
    'ferry:kv_tier_dropped_writes_total{reason="queue_full"}',
    'ferry:kv_tier_dropped_writes_total{reason="closed"}',
    "ferry:kv_tier_get_seconds_bucket",
    "ferry:kv_tier_get_seconds_count",
    "ferry:kv_tier_put_seconds_sum",
]


def test_exposed_metric_names() -> None:
    from kvcache.metrics import ERROR_CORRUPT, KV_TIER_ERRORS

    KV_TIER_ERRORS.labels(kind=ERROR_CORRUPT).inc(0)  # make the labelled series exist
    tier = open_tier("memory://")
    tier.put_many([("k", b"v")])
    tier.get_many(["k"])
    text = generate_latest(REGISTRY).decode()
    lines = [line for line in text.splitlines() if line.startswith("ferry:kv_tier")]
    for name in EXPECTED:
        assert any(line.startswith(name) for line in lines), name
    # Counters carry exactly one _total suffix.
    assert not any("_total_total" in line for line in lines)


def test_every_error_kind_is_exposed_from_the_start() -> None:
    """A fresh process shows every kind at 0: a series that first appears at 1 shows no increase to
    rate(), so the first tier error of a replica would reach no dashboard or alert."""
    from kvcache.metrics import ERROR_KINDS

    code = "import kvcache.metrics; from prometheus_client import generate_latest; print(generate_latest().decode())"
    text = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    for kind in ERROR_KINDS:
        assert f'ferry:kv_tier_errors_total{{kind="{kind}"}} 0.0' in text.splitlines(), kind
