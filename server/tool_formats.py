"""The tool-call formats whose whole answer is the call (``llama3_json``, ``pythonic`` /
``llama4_pythonic``, ``granite``, ``phi4_mini_json``, ``xlam``: held from their first characters by
one streamer, ``WholeAnswerStreamer``), and ``python_calls``, which reads a list of Python calls
without evaluating it. The formats that write each argument as text are in
``server/tool_formats_typed.py``. Registered in ``server/tool_parsers.py``, which lists every format.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping
from typing import Any, ClassVar

from server.tool_parser_base import ParsedCall, ToolParser, ToolStreamer, call_from, json_values


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"
    OPENERS: ClassVar[tuple[str, ...]] = ("{", TAG)  # how an answer that is a call begins

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        body = text.strip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG) :]
        if not body.lstrip().startswith("{"):
            return text, []
        values = json_values(body, separators=";")
        if not values:
            return text, []
        calls = [call_from(v) for v in values]
        if any(c is None for c in calls):
            return text, []
        return "", calls  # type: ignore[return-value]

    def streamer(self) -> ToolStreamer:
        return WholeAnswerStreamer(self)


class WholeAnswerStreamer(ToolStreamer):
    """For formats where the whole answer is the call: decided by its first visible characters —
    an answer that opens like a call is held and parsed at the end, any other streams as content."""

    def __init__(self, parser: WholeAnswerParser) -> None:
        self.parser = parser
        self.text = ""  # the opening, while it is not decided
        self.parts: list[str] = []  # an answer that opened like a call, in pieces (joined at the end)
        self.size = 0  # their length
        self.holding: bool | None = None  # None: not decided yet

    @property
    def held(self) -> int:
        return len(self.text) + self.size

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        if self.holding is not None:
            if self.holding:
                self.parts.append(text)
                self.size += len(text)
            return ("", []) if self.holding else (text, [])
        self.text += text
        head = self.text.lstrip()
        if not head:
            return "", []
        openers = self.parser.OPENERS
        if any(head.startswith(o) for o in openers):
            self.holding, self.parts, self.size, self.text = True, [self.text], len(self.text), ""
            return "", []
        if any(o.startswith(head) for o in openers):
            return "", []  # could still become an opener
        self.holding = False
        content, self.text = self.text, ""
        return content, []

    def finish(self) -> tuple[str, list[ParsedCall]]:
        if self.holding is False:
            return "", []
        text, self.text, self.parts, self.size = self.text + "".join(self.parts), "", [], 0
        return self.parser.parse(text)


class PythonicParser(ToolParser):
    name = "pythonic"
    START, END = "<|python_start|>", "<|python_end|>"
    OPENERS: ClassVar[tuple[str, ...]] = ("[", START)

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        body = text.strip()
        if body.startswith(self.START):
            body = body[len(self.START) :].strip().removesuffix(self.END).rstrip()
        calls = python_calls(body) if body.startswith("[") else None
        return ("", calls) if calls else (text, [])

    def streamer(self) -> ToolStreamer:
        return WholeAnswerStreamer(self)


class Llama4PythonicParser(PythonicParser):
    name = "llama4_pythonic"


class Llama4JsonParser(Llama3JsonParser):
    name = "llama4_json"  # vLLM's second name for the same format


def python_calls(text: str, names: Mapping[str, Any] | None = None) -> list[ParsedCall] | None:
    """The calls of a Python list of calls, ``[f(a=1), g()]``: names (dotted allowed) with keyword
    arguments whose values are literals (or bare ``names``, the values given: Olmo 3 writes JSON's
    ``null``, ``true``, ``false``); None for anything else (positional arguments, expressions, values
    JSON cannot hold). Parsed, never evaluated."""
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    return _read_calls(tree.elts, names) if isinstance(tree, ast.List) else None


def python_call_lines(text: str, names: Mapping[str, Any] | None = None) -> list[ParsedCall] | None:
    """The calls of Python statements that are each a call, one a line (Olmo 3's), read as
    ``python_calls`` reads a list's: the text parsed as it is written, so a call written over several
    lines, or a string holding a newline, reads as Python reads it."""
    try:
        statements = ast.parse(text, mode="exec").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    calls = [s.value for s in statements if isinstance(s, ast.Expr)]
    return _read_calls(calls, names) if len(calls) == len(statements) else None


def _read_calls(nodes: list[ast.expr], names: Mapping[str, Any] | None) -> list[ParsedCall] | None:
    if not nodes:
        return None
    calls = []
    for node in nodes:
        name = _dotted(node.func) if isinstance(node, ast.Call) else None
        if name is None or node.args or any(k.arg is None for k in node.keywords):
            return None
        try:
            args = {k.arg: _python_value(k.value, names or {}) for k in node.keywords}
            calls.append(ParsedCall(name, json.dumps(args, ensure_ascii=False)))
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
    return calls


def _python_value(node: ast.expr, names: Mapping[str, Any]) -> Any:
    if isinstance(node, ast.Name) and node.id in names:
        return names[node.id]
    if names and isinstance(node, (ast.List, ast.Tuple)):
        return [_python_value(item, names) for item in node.elts]
    if names and isinstance(node, ast.Dict) and all(k is not None for k in node.keys):
        return {
            ast.literal_eval(k): _python_value(v, names) for k, v in zip(node.keys, node.values, strict=True)
        }
    return ast.literal_eval(node)


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


class GraniteParser(ToolParser):
    name = "granite"
    TOKEN, TAG = "<|tool_call|>", "<tool_call>"
    OPENERS: ClassVar[tuple[str, ...]] = (TOKEN, TAG, "[")

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        body = text.strip().removeprefix(self.TOKEN).removeprefix(self.TAG).strip()
        calls = json_call_list(body) if body.startswith("[") else None
        return ("", calls) if calls else (text, [])

    def streamer(self) -> ToolStreamer:
        return WholeAnswerStreamer(self)


class XlamParser(ToolParser):
    """xLAM: the whole answer is a JSON array of ``{"name": …, "arguments": {…}}``, bare or in a
    fenced code block (```` ```json ````), after ``[TOOL_CALLS]`` or inside ``<tool_call>`` …
    ``</tool_call>``."""

    name = "xlam"
    FENCE, TAG, END_TAG, MARKER = "```", "<tool_call>", "</tool_call>", "[TOOL_CALLS]"
    OPENERS: ClassVar[tuple[str, ...]] = ("[", FENCE, TAG)

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        body = text.strip()
        if body.startswith(self.FENCE):
            inner = body[len(self.FENCE) :]
            inner = inner[len("json") :] if inner.startswith("json") else inner
            body = inner.removesuffix(self.FENCE).strip() if inner.rstrip().endswith(self.FENCE) else ""
        elif body.startswith(self.TAG):
            body = body[len(self.TAG) :].removesuffix(self.END_TAG).strip()
        body = body.removeprefix(self.MARKER).lstrip()
        calls = json_call_list(body) if body.startswith("[") else None
        return ("", calls) if calls else (text, [])

    def streamer(self) -> ToolStreamer:
        return WholeAnswerStreamer(self)


class Phi4MiniJsonParser(ToolParser):
    name = "phi4_mini_json"
    OPENER = "functools"
    OPENERS: ClassVar[tuple[str, ...]] = (OPENER,)

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        body = text.strip()
        calls = json_call_list(body[len(self.OPENER) :].strip()) if body.startswith(self.OPENER) else None
        return ("", calls) if calls else (text, [])

    def streamer(self) -> ToolStreamer:
        return WholeAnswerStreamer(self)


def json_call_list(text: str) -> list[ParsedCall] | None:
    """The calls of exactly one JSON array of call objects, or None."""
    values = json_values(text)
    if values is None or len(values) != 1 or not isinstance(values[0], list) or not values[0]:
        return None
    calls = [call_from(v) for v in values[0]]
    return None if any(c is None for c in calls) else calls  # type: ignore[return-value]


# The formats whose whole answer is the call (held from their first characters: WholeAnswerStreamer).
WholeAnswerParser = Llama3JsonParser | PythonicParser | GraniteParser | Phi4MiniJsonParser | XlamParser
