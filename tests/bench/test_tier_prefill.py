"""`bench/tier_prefill.py` on the tiny Llama: every server row measured with each prompt answered
(a non-200 raises), and the table written to JSON."""

from __future__ import annotations

import json
from pathlib import Path

from bench.tier_prefill import main


def test_tier_prefill_times_each_server(tiny_llama: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "tier.json"
    argv = ["--model", str(tiny_llama), "--prompt-len", "64", "--repeats", "2", "--num-threads", "1"]
    assert main([*argv, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["server"] for r in result["rows"]] == ["no tier", "memory tier"]
    assert result["rows"][0]["vs_no_tier"] == 1.0
    assert {name: len(runs) for name, runs in result["runs"].items()} == {"no tier": 2, "memory tier": 2}
    assert all(t > 0 for runs in result["runs"].values() for t in runs)
    assert "TTFT of a 64-token prompt, median of 2" in capsys.readouterr().out
