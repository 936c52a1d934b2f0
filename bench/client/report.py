"""``--report DIR``: PNG plots of a results directory and one self-contained HTML page.

Plots (matplotlib, Agg backend, so no display is needed):
* ``latency_cdf.png``: CDFs of TTFT, TPOT, ITL and E2E, one line per sweep point (raw records).
* ``throughput_vs_load.png``: request and output-token throughput per sweep point.
* ``latency_vs_load.png``: median and p99 of TTFT, TPOT and E2E per sweep point.
``report.html`` embeds them (data: URIs), so the page can be mailed or archived on its own.
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any

from bench.client.compare import load_summary
from bench.client.table import METRIC_ROWS, failures_text, fmt, lookup

_LATENCIES = [("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("ITL", "itl_s"), ("E2E", "e2e_s")]


def _records(results_dir: Path) -> list[dict[str, Any]]:
    path = results_dir / "raw.jsonl"
    if not path.is_file():
        return []
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _series(records: list[dict[str, Any]], point: dict[str, Any], key: str) -> list[float]:
    """Milliseconds of one latency for a point's measured, successful requests."""
    out: list[float] = []
    for r in records:
        if r["warmup"] or not r["ok"] or r["concurrency"] != point["concurrency"]:
            continue
        if r["request_rate"] != point["request_rate"]:
            continue
        value = r.get(key)
        if isinstance(value, list):
            out.extend(v * 1000.0 for v in value)
        elif value is not None:
            out.append(value * 1000.0)
    return sorted(out)


def _plot_cdfs(plt: Any, summary: dict[str, Any], records: list[dict[str, Any]], path: Path) -> None:
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, (name, key) in zip(axes.flat, _LATENCIES, strict=False):
        drawn = False
        for point in summary["points"]:
            values = _series(records, point, key)
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                ax.step(values, ys, where="post", label=point["label"])
                drawn = True
        ax.set_title(f"{name} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if key != "itl_s" else "fraction of gaps")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_throughput(plt: Any, summary: dict[str, Any], path: Path) -> None:
    points = summary["points"]
    xs = list(range(len(points)))
    labels = [p["label"] for p in points]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (title, key) in zip(
        axes,
        [
            ("request throughput (req/s)", "request_throughput"),
            ("output throughput (tok/s)", "output_throughput"),
        ],
        strict=False,
    ):
        ax.plot(xs, [p["metrics"][key] for p in points], marker="o")
        ax.set_title(title)
        ax.set_xticks(xs, labels)
        ax.set_xlabel("sweep point")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_latency(plt: Any, summary: dict[str, Any], path: Path) -> None:
    points = summary["points"]
    xs = list(range(len(points)))
    labels = [p["label"] for p in points]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, (name, key) in zip(
        axes, [("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("E2E", "e2e_ms")], strict=False
    ):
        for stat in ("median", "p99"):
            ys = [p["metrics"][key][stat] for p in points]
            ax.plot(xs, [float("nan") if y is None else y for y in ys], marker="o", label=stat)
        ax.set_title(f"{name} (ms)")
        ax.set_xticks(xs, labels)
        ax.set_xlabel("sweep point")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _html_table(summary: dict[str, Any]) -> str:
    points = summary["points"]
    head = "".join(f"<th>{html.escape(p['label'])}</th>" for p in points)
    fails = "".join(f"<td>{html.escape(failures_text(p['metrics']['failures']))}</td>" for p in points)
    rows = [f"<tr><td>failures by kind</td>{fails}</tr>"]
    for label, path, _ in METRIC_ROWS:
        cells = "".join(f"<td>{html.escape(fmt(lookup(p['metrics'], path)))}</td>" for p in points)
        rows.append(f"<tr><td>{html.escape(label)}</td>{cells}</tr>")
    return f"<table><thead><tr><th>metric</th>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
th, td {{ border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }}
td:first-child, th:first-child {{ text-align: left; }}
img {{ max-width: 100%; display: block; margin: 1em 0; }}
dt {{ font-weight: bold; }}
</style>
</head>
<body>
<h1>{title}</h1>
<dl>{info}</dl>
<h2>Summary</h2>
{table}
<h2>Plots</h2>
{images}
<script>
// Every plot is embedded; one that fails to decode is a broken report, so say so loudly.
for (const img of document.images) {{
  const check = () => {{ if (!img.naturalWidth) console.error("plot failed to load: " + img.alt); }};
  if (img.complete) {{ check(); }} else {{ img.addEventListener("load", check); img.addEventListener("error", check); }}
}}
</script>
</body>
</html>
"""


def write_report(results_dir: str, output_dir: str | None = None) -> Path:
    """Write the PNGs and report.html (into ``output_dir``, default the results directory)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    src = Path(results_dir)
    summary = load_summary(src)
    if not summary["points"]:
        raise ValueError(f"{src}: the summary has no finished sweep point to plot")
    out = Path(output_dir) if output_dir else (src if src.is_dir() else src.parent)
    out.mkdir(parents=True, exist_ok=True)
    records = _records(src if src.is_dir() else src.parent)
    plots = [
        ("latency_cdf.png", "latency CDFs"),
        ("throughput_vs_load.png", "throughput per sweep point"),
        ("latency_vs_load.png", "latency per sweep point"),
    ]
    _plot_cdfs(plt, summary, records, out / plots[0][0])
    _plot_throughput(plt, summary, out / plots[1][0])
    _plot_latency(plt, summary, out / plots[2][0])
    images = []
    for name, alt in plots:
        data = base64.b64encode((out / name).read_bytes()).decode()
        images.append(
            f'<h3>{html.escape(alt)}</h3><img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'
        )
    env = summary.get("environment") or {}
    info_items = {
        "run": summary.get("name"),
        "created": summary.get("created"),
        "target": summary.get("base_url"),
        "model": summary.get("model"),
        "endpoint": summary.get("endpoint"),
        "dataset": json.dumps(
            {k: v for k, v in (summary.get("dataset") or {}).items() if k != "token_source"}
        ),
        "ferry": f"{env.get('ferry_version')} ({(env.get('git') or {}).get('revision')})",
        "host": f"{env.get('cpu')} x{env.get('cpu_count')}; GPUs: {', '.join(env.get('gpus') or []) or 'none'}",
        "server lost": summary.get("server_lost"),
    }
    info = "".join(
        f"<dt>{html.escape(k)}</dt><dd>{html.escape(str(v))}</dd>"
        for k, v in info_items.items()
        if v is not None
    )
    title = f"ferry bench report: {summary.get('name', src.name)}"
    page = _PAGE.format(
        title=html.escape(title), info=info, table=_html_table(summary), images="\n".join(images)
    )
    path = out / "report.html"
    path.write_text(page, encoding="utf-8")
    return path
