"""Reading a ShareGPT file into conversations of (human message, reply) pairs.

The format vLLM's ``--dataset-name sharegpt`` reads (ShareGPT_V3_unfiltered_cleaned_split.json): a
JSON list of records, each with a ``conversations`` list of ``{"from": ROLE, "value": TEXT}`` turns.
JSON lines (one record a line) and the singular ``conversation`` key are read too. A record that
is not of this shape is an error naming it (``FILE: record [i]`` in a list, ``FILE:LINE`` in
JSON lines), so a wrong file fails at once instead of leaving a silently empty request set. A
well-formed record without a human turn answered by a reply is not an error: it has no pairs and
the dataset skips it, as vLLM skips its records of fewer than two turns.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.client.datasets.jsonl import DatasetFileError

HUMAN_ROLES = frozenset({"human", "user"})
NOT_A_REPLY = HUMAN_ROLES | {"system"}  # any other speaker ("gpt", "chatgpt", "bard", ...) replies


@dataclass(frozen=True)
class Conversation:
    where: str  # the record's place in the file, for messages
    pairs: tuple[tuple[str, str], ...]  # (human text, reply text), from the first human turn on


def read_conversations(path: Path) -> list[Conversation]:
    if not path.is_file():
        raise DatasetFileError(f"--dataset-path {path}: no such file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DatasetFileError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    return [_conversation(where, record) for where, record in _records(path, text)]


def _records(path: Path, text: str) -> list[tuple[str, Any]]:
    """(where, record) for every record: of the JSON list, else of every non-blank line."""
    try:
        whole = json.loads(text)
    except ValueError as exc:
        if text.lstrip().startswith("["):  # meant as one JSON list: say where it breaks
            line = getattr(exc, "lineno", "?")
            raise DatasetFileError(f"{path}:{line}: not JSON: {getattr(exc, 'msg', exc)}") from None
    else:
        if isinstance(whole, list):
            return [(f"{path}: record [{i}]", record) for i, record in enumerate(whole)]
        return [(f"{path}:1", whole)]  # one record: the same as a one-line JSON lines file
    records = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append((f"{path}:{lineno}", json.loads(line)))
        except ValueError as exc:
            raise DatasetFileError(
                f"{path}:{lineno}: not JSON: {exc} (expected a JSON list of ShareGPT records, "
                "or one record a line)"
            ) from None
    return records


def _conversation(where: str, record: Any) -> Conversation:
    if not isinstance(record, dict):
        raise DatasetFileError(f"{where}: a record must be a JSON object with a 'conversations' list")
    turns = record.get("conversations", record.get("conversation"))
    if not isinstance(turns, list):
        raise DatasetFileError(f'{where}: no \'conversations\' list of {{"from": ROLE, "value": TEXT}} turns')
    parsed: list[tuple[str, str]] = []
    for i, turn in enumerate(turns):
        if not (
            isinstance(turn, dict)
            and isinstance(turn.get("from"), str)
            and isinstance(turn.get("value"), str)
        ):
            shown = json.dumps(turn, ensure_ascii=False)
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            raise DatasetFileError(
                f'{where}: turn {i}: expected {{"from": ROLE, "value": TEXT}}, got {shown}'
            )
        parsed.append((turn["from"].lower(), turn["value"]))
    return Conversation(where, _pairs(parsed))


def _pairs(turns: list[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    """From the first human turn on, while a human turn is followed by a reply."""
    i = next((k for k, (role, _) in enumerate(turns) if role in HUMAN_ROLES), len(turns))
    pairs = []
    while i + 1 < len(turns) and turns[i][0] in HUMAN_ROLES and turns[i + 1][0] not in NOT_A_REPLY:
        pairs.append((turns[i][1], turns[i + 1][1]))
        i += 2
    return tuple(pairs)
