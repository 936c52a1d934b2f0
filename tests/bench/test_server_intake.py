"""`bench/server_intake.py` on the tiny Llama: both variants measured, every request answered
(the script raises on any non-200), and the intake / per-token split written to JSON."""

from __future__ import annotations

import json
from pathlib import Path

from bench.server_intake import main


def test_server_intake_measures_both_variants(tiny_llama: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "intake.json"
    argv = ["--model", str(tiny_llama), "--concurrency", "4", "--waves", "2", "--repeats", "1"]
    assert main([*argv, "--max-tokens", "1", "3", "--prompt-len", "8", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {(r["variant"], r["max_tokens"]): r for r in result["rows"]}
    assert set(rows) == {(v, mt) for v in ("ferry", "fastapi-routes") for mt in (1, 3)}
    for r in rows.values():
        assert len(r["runs_ms"]) == 1 and r["cpu_ms_per_request"] > 0
    assert set(result["fit"]) == {"ferry", "fastapi-routes"}
    assert "intake: ferry" in capsys.readouterr().out
