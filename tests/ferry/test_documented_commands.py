"""Every `ferry …` command line in the documentation parses with ferry's real argument parser, so a
renamed or removed flag cannot live on in a README a user copies from."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from ferry.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
DOCS = ["README.md", "ARCHITECTURE.md", "bench/client/README.md", "router/README.md"]
SHELL_FENCES = {"", "sh", "bash", "shell", "console"}
# `ferry serve …`, `.venv/bin/ferry up …`, `FOO=1 ferry router …`, `python -m ferry bench …`.
COMMAND = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S+\s+)*(?:\S*/)?(?:ferry|python3? -m ferry)\s+(.*)$")


def shell_blocks(text: str) -> list[str]:
    blocks, current, fence = [], None, ""
    for line in text.splitlines():
        if line.strip().startswith("```"):
            if current is None:
                current, fence = [], line.strip()[3:].strip()
            else:
                if fence in SHELL_FENCES:
                    blocks.append("\n".join(current))
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def documented_commands(path: Path) -> list[list[str]]:
    """The argv (after ``ferry``) of every command line in the shell blocks of ``path``."""
    out = []
    for block in shell_blocks(path.read_text()):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            match = COMMAND.match(line.strip().removeprefix("$ "))
            if match is None:
                continue
            argv = shlex.split(match.group(1), comments=True)
            # "[any ferry serve flag]" and the like stand for flags the reader fills in.
            if not any(arg.startswith("[") for arg in argv):
                out.append(argv)
    return out


@pytest.mark.parametrize("doc", DOCS)
def test_documented_ferry_commands_parse(doc: str) -> None:
    commands = documented_commands(REPO / doc)
    if doc in ("README.md", "bench/client/README.md", "router/README.md"):
        assert commands, f"{doc}: no ferry command found (has the format of its examples changed?)"
    for argv in commands:
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                build_parser().parse_args(argv)
        except SystemExit:
            pytest.fail(
                f"{doc}: `ferry {shlex.join(argv)}` does not parse: {err.getvalue().strip().splitlines()[-1]}"
            )
