"""``--compare a.json b.json …``: side-by-side metrics of summary files, with ratios to the first.

Sweep points are matched by label (``c=16``, ``rate=4``); a point missing from a file shows "-".
A ratio > 1 means "more" (better for throughput, worse for latency).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.client.table import METRIC_ROWS, fmt, lookup, render


def load_summary(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if p.is_dir():
        p = p / "summary.json"
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{p}: not a readable summary.json ({exc})") from None
    if not isinstance(data, dict) or "points" not in data:
        raise ValueError(f"{p}: not a ferry bench summary (no 'points')")
    return data


def _names(paths: list[str], summaries: list[dict[str, Any]]) -> list[str]:
    """Column names: each run's --label, else its results directory's name; made unique."""
    names = []
    for path, data in zip(paths, summaries, strict=False):
        p = Path(path).resolve()
        name = data.get("name") or (p.name if p.is_dir() else p.parent.name)
        if name in names:
            name = f"{name}#{len(names) + 1}"
        names.append(name)
    return names


def compare(paths: list[str]) -> tuple[str, dict[str, Any]]:
    """The printed tables and a JSON-able dict of the same numbers."""
    summaries = [load_summary(p) for p in paths]
    names = _names(paths, summaries)
    labels: list[str] = []
    for s in summaries:
        for point in s["points"]:
            if point["label"] not in labels:
                labels.append(point["label"])
    tables, result = [], {"files": [str(Path(p).resolve()) for p in paths], "names": names, "points": {}}
    for label in labels:
        per_file = [
            next((pt["metrics"] for pt in s["points"] if pt["label"] == label), None) for s in summaries
        ]
        headers = ["metric", names[0]]
        for name in names[1:]:
            headers += [name, f"{name}/{names[0]}"]
        rows, out_rows = [], {}
        for row_label, path, _ in METRIC_ROWS:
            values = [None if m is None else lookup(m, path) for m in per_file]
            if all(v is None for v in values):
                continue
            base = values[0]
            cells = [row_label, fmt(base)]
            ratios = []
            for v in values[1:]:
                ratio = (
                    v / base
                    if isinstance(v, (int, float)) and isinstance(base, (int, float)) and base
                    else None
                )
                ratios.append(ratio)
                cells += [fmt(v), "-" if ratio is None else f"{ratio:.3f}x"]
            rows.append(cells)
            out_rows[row_label] = {"values": values, "ratios_to_first": ratios}
        tables.append(render(headers, rows, f"compare {label}"))
        result["points"][label] = out_rows
    return "\n\n".join(tables), result


def write_compare(paths: list[str], output_dir: str | None) -> str:
    text, data = compare(paths)
    if output_dir:
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "compare.txt").write_text(text + "\n")
        (out / "compare.json").write_text(json.dumps(data, indent=2) + "\n")
    return text
