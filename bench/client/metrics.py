"""Summaries of raw request records: latency statistics, throughput, goodput, failures.

Percentiles use linear interpolation between closest ranks (numpy's default method), written
out here so the figures do not depend on numpy and can be checked by hand. Latencies in the
summary are milliseconds; throughput is per second of the run's measured phase. Warm-up records
are never counted.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.client.types import RequestRecord

PERCENTILES = (50.0, 90.0, 99.0)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation: position (n-1)*q/100 in sorted order."""
    if not values:
        raise ValueError("percentile of no values")
    data = sorted(values)
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


@dataclass
class LatencyStats:
    count: int = 0
    mean: float | None = None
    median: float | None = None
    p90: float | None = None
    p99: float | None = None
    std: float | None = None
    min: float | None = None
    max: float | None = None

    @classmethod
    def of(cls, seconds: Sequence[float]) -> LatencyStats:
        """Statistics in milliseconds of values given in seconds."""
        if not seconds:
            return cls()
        ms = [s * 1000.0 for s in seconds]
        return cls(
            count=len(ms),
            mean=statistics.fmean(ms),
            median=percentile(ms, 50.0),
            p90=percentile(ms, 90.0),
            p99=percentile(ms, 99.0),
            std=statistics.pstdev(ms) if len(ms) > 1 else 0.0,
            min=min(ms),
            max=max(ms),
        )


@dataclass
class Metrics:
    completed: int = 0
    failed: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    duration_s: float = 0.0
    total_input_tokens: int = 0
    total_output_tokens: int = 0
    cached_prompt_tokens: int | None = None  # prompt tokens the server reports served from its cache
    cached_prompt_fraction: float | None = None  # of the prompt tokens of requests that report it
    request_throughput: float = 0.0
    input_throughput: float = 0.0
    output_throughput: float = 0.0
    total_token_throughput: float = 0.0
    goodput: float | None = None  # requests/s meeting every --slo target
    good_requests: int | None = None
    slo_ms: dict[str, float] = field(default_factory=dict)
    token_count_mismatches: int = 0
    usage_missing: int = 0
    ttft_ms: LatencyStats = field(default_factory=LatencyStats)
    tpot_ms: LatencyStats = field(default_factory=LatencyStats)
    itl_ms: LatencyStats = field(default_factory=LatencyStats)
    e2e_ms: LatencyStats = field(default_factory=LatencyStats)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def meets_slo(rec: RequestRecord, slo_ms: dict[str, float]) -> bool:
    values = {"ttft": rec.ttft_s, "tpot": rec.tpot_s, "e2e": rec.e2e_s}
    for key, limit in slo_ms.items():
        v = values[key]
        # TPOT is undefined for a one-token answer: that request cannot miss a TPOT target.
        if v is None:
            if key == "tpot" and rec.ok:
                continue
            return False
        if v * 1000.0 > limit:
            return False
    return True


def compute_metrics(records: Iterable[RequestRecord], duration_s: float, slo_ms: dict[str, float]) -> Metrics:
    """Metrics of the measured (non-warm-up) records of one run, or of several runs pooled
    (then ``duration_s`` is the sum of their measured durations)."""
    recs = [r for r in records if not r.warmup]
    ok = [r for r in recs if r.ok]
    m = Metrics(completed=len(ok), failed=len(recs) - len(ok), duration_s=duration_s, slo_ms=dict(slo_ms))
    m.failures = dict(sorted(Counter(r.error_kind or "unknown" for r in recs if not r.ok).items()))
    m.total_input_tokens = sum(r.prompt_tokens or 0 for r in ok)
    m.total_output_tokens = sum(r.completion_tokens or 0 for r in ok)
    reporting = [r for r in ok if r.cached_tokens is not None]
    if reporting:
        m.cached_prompt_tokens = sum(r.cached_tokens or 0 for r in reporting)
        prompt = sum(r.prompt_tokens or 0 for r in reporting)
        m.cached_prompt_fraction = m.cached_prompt_tokens / prompt if prompt else 0.0
    m.token_count_mismatches = sum(r.token_count_mismatch for r in ok)
    m.usage_missing = sum(r.usage_missing for r in ok)
    if duration_s > 0:
        m.request_throughput = len(ok) / duration_s
        m.input_throughput = m.total_input_tokens / duration_s
        m.output_throughput = m.total_output_tokens / duration_s
        m.total_token_throughput = (m.total_input_tokens + m.total_output_tokens) / duration_s
    if slo_ms:
        m.good_requests = sum(1 for r in ok if meets_slo(r, slo_ms))
        m.goodput = m.good_requests / duration_s if duration_s > 0 else 0.0
    m.ttft_ms = LatencyStats.of([r.ttft_s for r in ok if r.ttft_s is not None])
    m.tpot_ms = LatencyStats.of([t for r in ok if (t := r.tpot_s) is not None])
    m.itl_ms = LatencyStats.of([gap for r in ok for gap in r.itl_s])
    m.e2e_ms = LatencyStats.of([r.e2e_s for r in ok if r.e2e_s is not None])
    return m
