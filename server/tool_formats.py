"""The tool-call formats whose whole answer is the call (``llama3_json``, ``pythonic`` /
``llama4_pythonic``, ``granite``, ``phi4_mini_json``: held from their first characters by one
streamer), and those that write each argument as text, typed by the request's tool schemas
(``qwen3_coder``, ``glm45``). Registered in ``server/tool_parsers.py``, which lists every format.
"""

from __future__ import annotations

import ast
import json
import math
import re
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from server.tool_parser_base import (
    MarkedCallParser,
    ParsedCall,
    ToolParser,
    ToolStreamer,
    call_from,
    dumps,
    json_values,
    loads,
)


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
        return _WholeAnswerStreamer(self)


class _WholeAnswerStreamer(ToolStreamer):
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
        return _WholeAnswerStreamer(self)


class Llama4PythonicParser(PythonicParser):
    name = "llama4_pythonic"


def python_calls(text: str) -> list[ParsedCall] | None:
    """The calls of a Python list of calls, ``[f(a=1), g()]``: names (dotted allowed) with keyword
    arguments whose values are literals; None for anything else (positional arguments, expressions,
    values JSON cannot hold). Parsed, never evaluated."""
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        name = _dotted(node.func) if isinstance(node, ast.Call) else None
        if name is None or node.args or any(k.arg is None for k in node.keywords):
            return None
        try:
            args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            calls.append(ParsedCall(name, json.dumps(args, ensure_ascii=False)))
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
    return calls


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
        return _WholeAnswerStreamer(self)


class Phi4MiniJsonParser(ToolParser):
    name = "phi4_mini_json"
    OPENER = "functools"
    OPENERS: ClassVar[tuple[str, ...]] = (OPENER,)

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        body = text.strip()
        calls = json_call_list(body[len(self.OPENER) :].strip()) if body.startswith(self.OPENER) else None
        return ("", calls) if calls else (text, [])

    def streamer(self) -> ToolStreamer:
        return _WholeAnswerStreamer(self)


def json_call_list(text: str) -> list[ParsedCall] | None:
    """The calls of exactly one JSON array of call objects, or None."""
    values = json_values(text)
    if values is None or len(values) != 1 or not isinstance(values[0], list) or not values[0]:
        return None
    calls = [call_from(v) for v in values[0]]
    return None if any(c is None for c in calls) else calls  # type: ignore[return-value]


class TypedArgumentsParser(MarkedCallParser):
    """Formats that write each argument as text: typed by the request's tool schemas (each format's
    ``typed``, as vLLM's parser of its name types them)."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, schemas: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self.schemas = schemas or {}  # function -> parameter -> its JSON schema

    def for_tools(self, tools: Sequence[Any]) -> ToolParser:
        schemas = {}
        for tool in tools:
            props = (tool.function.parameters or {}).get("properties") or {}
            schemas[tool.function.name] = {k: v for k, v in props.items() if isinstance(v, Mapping)}
        return type(self)(schemas)

    @abstractmethod
    def read_call(self, body: str) -> tuple[str, list[tuple[str, str]]] | None:
        """(function name, [(parameter, its text)]) of one call's body, or None if it is not one."""

    @staticmethod
    @abstractmethod
    def typed(value: str, schema: Mapping[str, Any] | None) -> Any:
        """A parameter's value from its text and its schema (None: the tool does not declare it)."""

    def read_body(self, body: str) -> list[ParsedCall] | None:
        read = self.read_call(body)
        if read is None:
            return None
        name, pairs = read
        schemas = self.schemas.get(name, {})
        arguments = dumps({key: self.typed(value, schemas.get(key)) for key, value in pairs})
        return None if arguments is None else [ParsedCall(name, arguments)]


class Glm45Parser(TypedArgumentsParser):
    name = "glm45"
    _PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)(?:</arg_value>|$)", re.S)
    _NAME = re.compile(r"[\w.\-]+")

    def read_call(self, body: str) -> tuple[str, list[tuple[str, str]]] | None:
        name = body.strip().partition("\n")[0].split("<arg_key>", 1)[0].strip()
        if not self._NAME.fullmatch(name):
            return None
        return name, [(k.strip(), v.strip()) for k, v in self._PAIR.findall(body)]

    @staticmethod
    def typed(value: str, schema: Mapping[str, Any] | None) -> Any:
        """Strings as written; anything else (undeclared parameters too) decoded as JSON, else as a
        Python literal (GLM writes ``True``, ``{'a': 1}``), else kept as text."""
        kind = None if schema is None else schema.get("type")
        if kind == "string" or (isinstance(kind, list) and "string" in kind):
            return value
        try:
            return loads(value)
        except ValueError:
            return _literal(value)


class Qwen3CoderParser(TypedArgumentsParser):
    name = "qwen3_coder"
    _FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?$", re.S)
    _PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)

    def read_call(self, body: str) -> tuple[str, list[tuple[str, str]]] | None:
        m = self._FUNCTION.match(body)
        if m is None or not m.group(1).strip():
            return None
        pairs = self._PARAMETER.findall(m.group(2))
        return m.group(1).strip(), [(k.strip(), v.removeprefix("\n").removesuffix("\n")) for k, v in pairs]

    @staticmethod
    def typed(value: str, schema: Mapping[str, Any] | None) -> Any:
        """``null`` is null; a parameter the tool does not declare, or one without a type, is text;
        otherwise by its type's name, as Qwen3-Coder's tool schemas spell them (``integer``,
        ``number``/``float``, ``boolean``, ``object``/``array``; a value that does not read as its
        type stays text)."""
        if value.lower() == "null":
            return None
        kind = None if schema is None else schema.get("type", "string")
        if kind is None:
            return value
        if isinstance(kind, list):  # ["string", "null"]: a string, unless it is null (read above)
            kinds = [str(k).lower() for k in kind if k != "null"]
            kind = kinds[0] if len(kinds) == 1 else ("string" if "string" in kinds else "")
        kind = str(kind).strip().lower()
        if kind in ("string", "str", "text", "varchar", "char", "enum"):
            return value
        if kind.startswith(("int", "uint", "long", "short", "unsigned")):
            try:
                return int(value)
            except ValueError:
                return value
        if kind.startswith(("num", "float")):
            try:
                number = float(value)
            except ValueError:
                return value
            if not math.isfinite(number):  # JSON has no inf or nan
                return value
            return int(number) if number.is_integer() else number
        if kind in ("boolean", "bool", "binary"):
            return value.lower() == "true"
        if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
            try:
                return loads(value)
            except ValueError:
                pass
        return _literal(value)


def _literal(value: str) -> Any:
    """A Python literal's value where JSON can hold it (never evaluated), else the text itself."""
    try:
        decoded = ast.literal_eval(value)
        json.dumps(decoded, allow_nan=False)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return value
    return decoded


# The formats whose whole answer is the call (held from their first characters: _WholeAnswerStreamer).
WholeAnswerParser = Llama3JsonParser | PythonicParser | GraniteParser | Phi4MiniJsonParser
