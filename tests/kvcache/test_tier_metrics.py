"""The tier's Prometheus series are exposed under exactly the documented names."""

from __future__ import annotations

from prometheus_client import REGISTRY, generate_latest

import kvcache.metrics  # noqa: F401  (registers the collectors)
from kvcache.tier import open_tier

EXPECTED = [
    "ferry:kv_tier_hits_total",
    "ferry:kv_tier_misses_total",
    "ferry:kv_tier_bytes_read_total",
    "ferry:kv_tier_bytes_written_total",
    'ferry:kv_tier_errors_total{kind="corrupt"}',
    "ferry:kv_tier_dropped_writes_total",
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
