"""Pure parts of the bench client: percentiles, per-request figures, goodput, SSE parsing, flags."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from bench.client.config import ConfigError, LoadPoint, parse_points, parse_slo
from bench.client.load import arrival_gaps
from bench.client.metrics import compute_metrics, percentile
from bench.client.sse import SSEParser
from bench.client.types import RequestRecord


def _rec(i: int, **kw) -> RequestRecord:
    base = dict(
        run=0,
        concurrency=1,
        request_rate=None,
        repeat=0,
        chain=i,
        index=i,
        warmup=False,
        session_id=None,
        turn=0,
        input_len=4,
        output_len=4,
    )
    base.update(kw)
    return RequestRecord(**base)


@pytest.mark.parametrize("n", [1, 2, 7, 100])
def test_percentile_matches_numpy_linear(n: int) -> None:
    rng = random.Random(n)
    values = [rng.uniform(0, 10) for _ in range(n)]
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), abs=1e-12)
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)


def test_compute_metrics_exact_values() -> None:
    ok1 = _rec(
        0,
        ok=True,
        ttft_s=0.1,
        e2e_s=0.4,
        itl_s=[0.1, 0.1, 0.1],
        prompt_tokens=10,
        completion_tokens=4,
        stream_chunks=4,
    )
    ok2 = _rec(
        1,
        ok=True,
        ttft_s=0.3,
        e2e_s=0.5,
        itl_s=[0.2],
        prompt_tokens=6,
        completion_tokens=3,
        stream_chunks=2,
        token_count_mismatch=True,
    )
    bad = _rec(2, ok=False, error_kind="http_500")
    gone = _rec(3, ok=False, error_kind="not_sent")
    warm = _rec(4, warmup=True, ok=True, ttft_s=9.0, e2e_s=9.0, prompt_tokens=99, completion_tokens=99)
    m = compute_metrics([ok1, ok2, bad, gone, warm], duration_s=2.0, slo_ms={"ttft": 200, "tpot": 150})
    assert (m.completed, m.failed) == (2, 2)
    assert m.failures == {"http_500": 1, "not_sent": 1}
    assert (m.total_input_tokens, m.total_output_tokens) == (16, 7)
    assert m.request_throughput == 1.0 and m.output_throughput == 3.5 and m.total_token_throughput == 11.5
    # TPOT = (e2e - ttft) / (n - 1): 0.3/3 = 100 ms and 0.2/2 = 100 ms.
    assert m.tpot_ms.mean == pytest.approx(100.0)
    assert m.ttft_ms.median == pytest.approx(200.0) and m.ttft_ms.p99 == pytest.approx(298.0)
    assert m.itl_ms.count == 4 and m.itl_ms.mean == pytest.approx(125.0)
    # Only ok1 meets ttft <= 200 ms (ok2 has 300 ms).
    assert m.good_requests == 1 and m.goodput == 0.5
    assert m.token_count_mismatches == 1


def test_tpot_undefined_for_one_token() -> None:
    assert _rec(0, ok=True, ttft_s=0.1, e2e_s=0.1, completion_tokens=1).tpot_s is None
    assert _rec(0, ok=True, ttft_s=0.1, e2e_s=0.5, completion_tokens=5).tpot_s == pytest.approx(0.1)


def test_sse_parser_events() -> None:
    p = SSEParser()
    lines = [
        ": keep-alive",
        'data: {"a": 1}',
        "",
        "event: x",
        "data: line1",
        "data:line2",
        "",
        "data: [DONE]",
        "",
    ]
    events = [e for e in (p.feed(line) for line in lines) if e is not None]
    assert events == ['{"a": 1}', "line1\nline2", "[DONE]"]
    p.feed("data: tail")
    assert p.flush() == "tail" and p.flush() is None
    # An empty data field dispatches nothing (the SSE standard), it is no unparseable chunk.
    assert [p.feed(line) for line in ["data:", ""]] == [None, None]
    assert [p.feed(line) for line in ["data: ", "", "data: x", ""]] == [None, None, None, "x"]


def test_flag_parsing() -> None:
    assert parse_slo("ttft=500,tpot=50") == {"ttft": 500.0, "tpot": 50.0}
    with pytest.raises(ConfigError, match="KEY one of"):
        parse_slo("latency=3")
    with pytest.raises(ConfigError, match="> 0"):
        parse_slo("ttft=0")
    points = parse_points("1,4", "2,inf")
    assert points == (LoadPoint(1, 2.0), LoadPoint(1, math.inf), LoadPoint(4, 2.0), LoadPoint(4, math.inf))
    assert [p.label for p in points] == ["c=1 rate=2", "c=1", "c=4 rate=2", "c=4"]
    assert parse_points(None, None) == (LoadPoint(None, math.inf),)
    with pytest.raises(ConfigError, match="integers"):
        parse_points("a", None)


def test_arrival_gaps_reproducible_and_gamma_mean() -> None:
    a = arrival_gaps(10.0, 0.5, 2000, seed=7)
    assert a == arrival_gaps(10.0, 0.5, 2000, seed=7)
    assert a != arrival_gaps(10.0, 0.5, 2000, seed=8)
    assert a[0] == 0.0
    assert sum(a[1:]) / (len(a) - 1) == pytest.approx(0.1, rel=0.1)
    assert arrival_gaps(math.inf, 1.0, 3, seed=0) == [0.0, 0.0, 0.0]


def test_secrets_never_reach_the_results() -> None:
    from bench.client.environment import redact_argv, redact_flags

    argv = [
        "ferry",
        "bench",
        "--api-key",
        "sk-1",
        "--header",
        "Authorization: Bearer sk-2",
        "--header=X-Trace: 7",
        "--api-key=sk-3",
        "--model",
        "m",
    ]
    assert redact_argv(argv) == [
        "ferry",
        "bench",
        "--api-key",
        "<redacted>",
        "--header",
        "Authorization: <redacted>",
        "--header=X-Trace: 7",
        "--api-key=<redacted>",
        "--model",
        "m",
    ]
    flags = redact_flags({"api_key": "sk-1", "header": ["authorization:x", "X-Trace: 7"], "model": "m"})
    assert flags == {
        "api_key": "<redacted>",
        "header": ["authorization: <redacted>", "X-Trace: 7"],
        "model": "m",
    }


@pytest.mark.parametrize(("flag", "value"), [("--burstiness", "inf"), ("--burstiness", "nan"),
                                             ("--burstiness", "0"), ("--timeout", "nan"),
                                             ("--timeout", "inf"), ("--timeout", "-1")])  # fmt: skip
def test_burstiness_and_timeout_are_finite_and_positive(flag: str, value: str) -> None:
    """nan passed every comparison and inf burstiness wrote Infinity into summary.json."""
    import argparse

    from bench.args import add_bench_args
    from bench.client.config import BenchConfig

    args = add_bench_args(argparse.ArgumentParser()).parse_args(
        ["--base-url", "http://127.0.0.1:9", flag, value]
    )
    with pytest.raises(ConfigError, match=f"^{flag} must be a finite number > 0$"):
        BenchConfig.from_args(args)
