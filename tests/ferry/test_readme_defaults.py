"""The defaults README.md states are the code's, so a default changed in code without the doc (or the
other way round) fails here: `ferry serve`'s flag table and, inline, `ferry serve` and `ferry router`
flags ("`--pd-threshold`, default 64") against the argument parsers; the `ferry up` YAML schema
against ``ClusterConfig()``.

A cell is read as a value when it is one: a number, a size (`8 MiB`), a duration (`30 days`), a
backticked literal (`auto`, `["*"]`), `on`, or `off` / `none` (no value). Anything else is prose saying
where the value comes from at run time ("demo model", "torch's default", "`--max-loras`"), and then
the parser's default must be unset, since something else resolves it."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from ferry.cli import build_parser
from ferry.cluster.config import ClusterConfig, ConfigError, parse_config
from server.args import server_config

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
PROSE = object()  # a cell that names no value: the parser's default must be unset
UNSET = (None, False, "")

# Cells that hold a value the parser leaves unset and the server resolves: README's value is checked
# against the resolved configuration instead (ServerConfig attribute of a bare `ferry serve`).
RESOLVED = {"--max-batch-concurrency": "max_batch_concurrency"}
# A row whose defaults cannot be paired with its flags by position: spelled out here, and the row's
# cell must still read as recorded, so an edit to it is looked at.
UNPAIRED = {
    "--allowed-origins": ('`["*"]`, off', ['`["*"]`', '`["*"]`', '`["*"]`', "off"]),
}
SIZES = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def parser_default(parser: argparse.ArgumentParser, flag: str) -> Any:
    for action in parser._actions:
        if flag in action.option_strings:
            return action.default
    raise KeyError(flag)


def has_flag(parser: argparse.ArgumentParser, flag: str) -> bool:
    return any(flag in a.option_strings for a in parser._actions)


def drop_parentheticals(text: str) -> str:
    while True:
        shorter = re.sub(r"\([^()]*\)", "", text)
        if shorter == text:
            return " ".join(text.split())
        text = shorter


def documented_value(cell: str) -> Any:
    """What a default cell says: a value, ``UNSET`` (off / none) or ``PROSE``."""
    cell = drop_parentheticals(cell).strip()
    if cell == "on" or cell.endswith(" on"):
        return True
    if cell in ("off", "none"):
        return UNSET
    if m := re.fullmatch(r"`([^`]+)`", cell):
        inner = m.group(1)
        if inner.startswith(("--", "$")):
            return PROSE
        try:
            return json.loads(inner)
        except ValueError:
            return inner
    if m := re.fullmatch(r"(\d+(?:\.\d+)?)(?: tokens| s| seconds)?", cell):
        return float(m.group(1))
    if m := re.fullmatch(r"(\d+) (KiB|MiB|GiB)", cell):
        return int(m.group(1)) * SIZES[m.group(2)]
    if m := re.fullmatch(r"(\d+) days?", cell):
        return int(m.group(1)) * 86400
    return PROSE


def matches(default: Any, documented: Any) -> bool:
    if documented is PROSE:
        return default is None
    if documented is UNSET:
        return default in UNSET
    if isinstance(documented, float):
        return isinstance(default, (int, float)) and not isinstance(default, bool) and default == documented
    return default == documented


def split_cells(row: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", row.strip().strip("|"))]


def serve_table_rows() -> list[tuple[list[str], str, str]]:
    """(flags, default cell, row) for every row of README's `ferry serve` flag table that names flags."""
    text = README.read_text()
    section = text.split("## `ferry serve`", 1)[1].split("\n##", 1)[0]
    rows = []
    for line in section.splitlines():
        if not line.startswith("| `-"):
            continue
        cells = split_cells(line)
        flags = re.findall(r"`(--[a-z0-9-]+)", drop_parentheticals(cells[0]))
        if flags:
            rows.append((flags, cells[1], line))
    return rows


def pairs() -> list[tuple[str, str]]:
    out = []
    for flags, cell, row in serve_table_rows():
        if flags[0] in UNPAIRED:
            recorded, values = UNPAIRED[flags[0]]
            assert cell == recorded, f"README's row for {flags[0]} changed: {row}"
            out.extend(zip(flags, values, strict=True))
            continue
        parts = [cell] if len(flags) == 1 else [p.strip() for p in drop_parentheticals(cell).split(",")]
        if len(parts) == 1:
            parts = parts * len(flags)
        assert len(parts) == len(flags), f"cannot pair defaults {parts} with flags {flags}: {row}"
        out.extend(zip(flags, parts, strict=True))
    return out


def test_serve_flag_table_defaults_are_the_parsers() -> None:
    serve = subparser("serve")
    checked = pairs()
    # The table's shape is what this test reads: if it stops finding rows, it must say so.
    assert len(checked) >= 70, f"only {len(checked)} flags read from README's `ferry serve` table"
    resolved = server_config(serve.parse_args([]))
    wrong = []
    for flag, cell in checked:
        documented = documented_value(cell)
        if flag in RESOLVED:
            actual = getattr(resolved, RESOLVED[flag])
            ok = parser_default(serve, flag) is None and matches(actual, documented)
        else:
            actual = parser_default(serve, flag)
            ok = matches(actual, documented)
        if not ok:
            wrong.append(f"{flag}: README says {cell!r}, the parser's default is {actual!r}")
    assert not wrong, "\n".join(wrong)


INLINE = re.compile(r"`(--[a-z0-9-]+)[^`]*`(?:,| \()\s*default:?\s+(`[^`]+`|[^,;)`]+)")


def inline_claims() -> list[tuple[str, str, str, str]]:
    """(doc, heading, flag, default text) for every "`--flag …` (default X" / "`--flag`, default X"."""
    out = []
    for doc in ("README.md", "router/README.md"):
        heading = ""
        for block in re.split(r"\n(?=##)", (REPO / doc).read_text()):
            heading = block.splitlines()[0] if block.startswith("##") else heading
            for m in INLINE.finditer(block):
                out.append((doc, heading, m.group(1), " ".join(m.group(2).split())))
    return out


def test_inline_flag_defaults_are_the_parsers() -> None:
    serve, router = subparser("serve"), subparser("router")
    claims = inline_claims()
    found = {(flag, text) for _, _, flag, text in claims}
    # Claims this test was written against; more may come, these must still be read.
    assert {
        ("--pd-threshold", "64 tokens"),
        ("--decode-penalty-tokens", "0"),
        ("--max-file-bytes", "100 MiB"),
    } <= found
    wrong = []
    for doc, heading, flag, text in claims:
        in_serve, in_router = has_flag(serve, flag), has_flag(router, flag)
        about_router = doc.startswith("router/") or re.search(r"router|disaggregation", heading, re.I)
        parser = router if in_router and (about_router or not in_serve) else serve
        if not has_flag(parser, flag):
            wrong.append(f"{doc}: {flag} is no flag of `ferry serve` or `ferry router`")
            continue
        documented = documented_value(text)
        if documented is PROSE and not text.startswith(("`--", "the ")):
            wrong.append(f"{doc}: cannot read the default {text!r} of {flag}")
        elif not matches(parser_default(parser, flag), documented):
            wrong.append(f"{doc}: {flag} default {text!r}, the parser's is {parser_default(parser, flag)!r}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(
    ("cell", "value"),
    [
        ("64", 64.0),
        ("`auto`", "auto"),
        ('`["*"]`', ["*"]),
        ("8 MiB", 8 << 20),
        ("30 days", 2592000),
        ("on (with prefix caching)", True),
        ("caching on", True),
        ("off", UNSET),
        ("`--max-loras`", PROSE),
        ("model's `max_position_embeddings`", PROSE),
    ],
)
def test_cells_read_as_values(cell: str, value: Any) -> None:
    read = documented_value(cell)
    if value is UNSET or value is PROSE:
        assert read is value
    else:
        assert read == value and type(read) is type(value)


def test_up_yaml_schema_is_the_default_cluster() -> None:
    """README's `ferry up` YAML block says "every key optional" and shows each key at its default:
    read as a cluster file, it is the cluster `ferry up` runs with no file."""
    section = README.read_text().split("## `ferry up`", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block is not None, "README's `ferry up` section has no YAML block"
    data = yaml.safe_load(block.group(1))
    # Every key of the file format is shown (block_size is no key: it comes from the pools' args).
    assert set(data) == {f.name for f in dataclasses.fields(ClusterConfig)} - {"block_size"}
    with pytest.raises(ConfigError, match="block_size"):
        parse_config({"block_size": 16})
    assert parse_config(data, REPO) == ClusterConfig()
