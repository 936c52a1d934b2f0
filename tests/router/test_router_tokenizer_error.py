"""`ferry router --model DIR` without a tokenizer.json: the error tells the operator what the router
takes (its --model), not a --tokenizer flag only `ferry serve` has."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_router_tokenizer_error_names_only_flags_the_router_has(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")  # a model directory without its tokenizer.json
    done = subprocess.run(
        [sys.executable, "-m", "ferry", "router", "--model", str(tmp_path), "--port", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.startswith(f"ferry router: error: {tmp_path} has no tokenizer.json")
    assert "`ferry router --model DIR` takes the directory that holds it" in done.stderr
    help_text = subprocess.run(
        [sys.executable, "-m", "ferry", "router", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    # Every flag suggested without naming `ferry serve` is one the router takes.
    for flag in re.findall(r"(?<!ferry serve )(--[a-z-]+)", done.stderr):
        assert flag in help_text, f"the router's error suggests {flag}, which `ferry router` does not take"
