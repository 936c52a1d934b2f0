"""`bench/burst_trace.py` on the tiny Llama: the trace hook records in every process of a replica
with API server processes and in this one, and each wave's phases come out in their order."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.burst_trace import PHASES

REPO = Path(__file__).resolve().parents[2]


def test_burst_trace_times_each_phase_in_every_mode(tiny_llama: Path, tmp_path: Path) -> None:
    # In a process of its own: the in-process mode's hooks wrap the engine's modules as they are
    # imported (and must not stay in this one).
    out = tmp_path / "trace.json"
    argv = ["--model", str(tiny_llama), "--modes", "in-process", "2", "--concurrency", "4", "--waves", "2"]
    argv += ["--max-tokens", "2", "--prompt-len", "8", "--trace-dir", str(tmp_path / "t"), "--out", str(out)]
    run = subprocess.run(
        [sys.executable, "-m", "bench.burst_trace", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    waves = json.loads(out.read_text())["waves"]
    assert set(waves) == {"in-process", "2"} and all(len(w) == 2 for w in waves.values())
    for mode, rows in waves.items():
        for row in rows:
            assert set(row) == set(PHASES)
            # the engine's events (the engine process's, behind API servers) and the app's
            assert row["taken_in"] is not None and row["step"] is not None and row["step_ms"] > 0
            assert row["taken_in"] <= row["gathered"] <= row["step"] < row["ttft"] + row["sends"]
            if mode == "2":  # the API server processes' own events
                assert row["parsed"] is not None and row["parsed"] <= row["taken_in"]
            else:
                assert row["parsed"] is None
    assert "TTFT-step" in run.stdout and "in-process" in run.stdout
