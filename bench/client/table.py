"""Plain-text tables for the terminal: metric rows, one column per sweep point (or per file)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# (label, path into a metrics dict, higher_is_better). Paths are dotted keys.
METRIC_ROWS: list[tuple[str, str, bool]] = [
    ("requests ok", "completed", True),
    ("requests failed", "failed", False),
    ("duration (s)", "duration_s", False),
    ("request throughput (req/s)", "request_throughput", True),
    ("input throughput (tok/s)", "input_throughput", True),
    ("output throughput (tok/s)", "output_throughput", True),
    ("total throughput (tok/s)", "total_token_throughput", True),
    ("prompt tokens from cache (fraction)", "cached_prompt_fraction", True),
    ("goodput (req/s)", "goodput", True),
]
for _name, _key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms")):
    for _stat in ("mean", "median", "p90", "p99"):
        METRIC_ROWS.append((f"{_name} {_stat} (ms)", f"{_key}.{_stat}", False))
METRIC_ROWS.append(("token count mismatches", "token_count_mismatches", False))
# Rows shown only when some point has a value (--slo given; the server reports cached tokens).
OPTIONAL_ROWS = {"goodput", "cached_prompt_fraction"}


def lookup(metrics: dict[str, Any], path: str) -> Any:
    value: Any = metrics
    for part in path.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) < 1e6 else f"{value:.4g}"
    return str(value)


def render(headers: Sequence[str], rows: Sequence[Sequence[str]], title: str | None = None) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=False))
        )

    rule = "-" * (sum(widths) + 2 * (len(widths) - 1))
    out = []
    if title:
        out += [title, "=" * len(rule)]
    out += [line(headers), rule, *(line(r) for r in rows)]
    return "\n".join(out)


def failures_text(failures: dict[str, int]) -> str:
    return ", ".join(f"{k}:{v}" for k, v in failures.items()) or "-"


def summary_table(points: Sequence[dict[str, Any]], title: str) -> str:
    """Rows = metrics, columns = sweep points (each point's pooled metrics)."""
    headers = ["metric", *(p["label"] for p in points)]
    rows = [
        [label, *(fmt(lookup(p["metrics"], path)) for p in points)]
        for label, path, _ in METRIC_ROWS
        if path not in OPTIONAL_ROWS or any(lookup(p["metrics"], path) is not None for p in points)
    ]
    rows.insert(2, ["failures by kind", *(failures_text(p["metrics"]["failures"]) for p in points)])
    return render(headers, rows, title)
