"""bench/grammar_cost.py runs end to end on the tests' tiny tokenizer: each row is ferry's or
xgrammar's compile of a case and a walk of its output, a refusal being ferry's 400 message
(no timing is checked: the numbers are the bench's to report)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import grammar_cost


def test_rows_side_by_side(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv("FERRY_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "grammar_cost.json"
    args = ["-k", "json object", "regex .{0,500}", "--vocab-size", "1000", "--max-tokens", "40"]
    assert grammar_cost.main([*args, "--budget", "120", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["case"], r["mode"], r["status"]) for r in rows] == [
        ("json object", "ferry", "ok"),
        ("json object", "xgrammar", "ok"),
        ("regex .{0,500}", "ferry", "refused"),
        ("regex .{0,500}", "xgrammar", "ok"),
    ]
    assert [r["tokens"] for r in rows] == [40, 40, 0, 40]
    assert rows[2]["refused"].startswith("structured outputs regex has the counted repetition '{0,500}'")
    assert "400: structured outputs regex" in capsys.readouterr().out
