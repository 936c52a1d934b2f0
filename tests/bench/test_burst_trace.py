"""`bench/burst_trace.py` on the tiny Llama: the trace hook records in every process of a replica
with API server processes and in this one, and each wave's phases come out in their order."""

from __future__ import annotations

import json
from pathlib import Path

from bench.burst_trace import PHASES, main


def test_burst_trace_times_each_phase_in_every_mode(tiny_llama: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "trace.json"
    argv = ["--model", str(tiny_llama), "--modes", "in-process", "2", "--concurrency", "4", "--waves", "2"]
    argv += ["--max-tokens", "2", "--prompt-len", "8", "--trace-dir", str(tmp_path / "t"), "--out", str(out)]
    assert main(argv) == 0
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
    table = capsys.readouterr().out
    assert "TTFT-step" in table and "in-process" in table
