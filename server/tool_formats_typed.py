"""The tool-call formats that write each argument as text, typed by the request's tool schemas
(``qwen3_coder`` / ``qwen3_xml``, ``seed_oss``, ``glm45`` / ``glm47``, ``minimax_m2``; Step-3's in
``server/tool_formats_more.py`` too): ``TypedArgumentsParser`` and its formats. Registered in
``server/tool_parsers.py``, which lists every format.
"""

from __future__ import annotations

import ast
import json
import math
import re
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

from server.tool_parser_base import MarkedCallParser, ParsedCall, ToolParser, dumps, loads


class TypedArgumentsParser(MarkedCallParser):
    """Formats that write each argument as text: typed by the request's tool schemas (each format's
    ``typed``, as vLLM's parser of its name types them)."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, schemas: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self.schemas = schemas or {}  # function -> parameter -> its JSON schema

    def for_tools(self, tools: Sequence[Any]) -> ToolParser:
        schemas = {}
        for tool in tools:
            props = (tool.function.parameters or {}).get("properties")
            # A client's broken schema (``properties`` not an object) leaves the values untyped.
            props = props if isinstance(props, Mapping) else {}
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


class Glm47Parser(Glm45Parser):
    name = "glm47"  # GLM-4.7 (no newline after the name; vLLM's one class reads both)


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


class Qwen3XmlParser(Qwen3CoderParser):
    name = "qwen3_xml"  # vLLM's second name for Qwen3-Coder's format


class SeedOssParser(Qwen3CoderParser):
    """Seed-OSS: Qwen3-Coder's calls inside ``<seed:tool_call>`` … ``</seed:tool_call>``, values
    typed as ``qwen3_coder``'s."""

    name = "seed_oss"
    START, END = "<seed:tool_call>", "</seed:tool_call>"


class MinimaxM2Parser(TypedArgumentsParser):
    """MiniMax-M2: ``<minimax:tool_call>`` then one or more ``<invoke name="NAME">`` with
    ``<parameter name="KEY">VALUE</parameter>`` each and ``</invoke>``, then
    ``</minimax:tool_call>``; values typed by the tool's schema (``typed``)."""

    name = "minimax_m2"
    START, END = "<minimax:tool_call>", "</minimax:tool_call>"
    _INVOKE = re.compile(r"\s*<invoke name=([^>]*)>(.*?)</invoke>\s*", re.S)
    _PARAMETER = re.compile(r"<parameter name=([^>]*)>(.*?)</parameter>", re.S)
    # The types a value is tried as, in this order (a string last: it always reads).
    _PRIORITY = (
        "integer",
        "int",
        "number",
        "float",
        "boolean",
        "bool",
        "object",
        "array",
        "string",
        "str",
        "text",
    )

    def read_call(self, body: str) -> tuple[str, list[tuple[str, str]]] | None:
        m = self._INVOKE.fullmatch(body)
        name = _unquoted(m.group(1)) if m is not None else ""
        if not name:
            return None
        return name, [(_unquoted(k), v.strip()) for k, v in self._PARAMETER.findall(m.group(2))]

    def read_body(self, body: str) -> list[ParsedCall] | None:
        """Every ``<invoke>`` of the section (only whitespace between them; one cut off at the end of
        the answer is dropped, the complete ones kept)."""
        calls: list[ParsedCall] = []
        pos = 0
        for m in self._INVOKE.finditer(body):
            if m.start() != pos:
                return None
            pos = m.end()
            read = super().read_body(m.group(0))
            if read is None:
                return None
            calls += read
        rest = body[pos:].lstrip()
        if not calls or (rest and not rest.startswith("<invoke")):
            return None
        return calls

    @classmethod
    def typed(cls, value: str, schema: Mapping[str, Any] | None) -> Any:
        """``null`` / ``none`` / ``nil`` are null; otherwise the first of the schema's types (its
        ``type``, its ``enum``'s values', its ``anyOf`` / ``oneOf`` / ``allOf``'s; a parameter the
        tool does not declare is a string) the text reads as, in ``_PRIORITY``'s order, else JSON,
        else the text."""
        if value.lower() in ("null", "none", "nil"):
            return None
        kinds = {k.lower() for k in _schema_types(schema)} or {"string"}
        for kind in cls._PRIORITY:
            if kind not in kinds:
                continue
            if kind in ("string", "str", "text"):
                return value
            try:
                if kind in ("integer", "int"):
                    return int(value)
                if kind in ("number", "float"):
                    number = float(value)
                    if math.isfinite(number):
                        return int(number) if number.is_integer() else number
                elif kind in ("boolean", "bool"):
                    flag = value.strip().lower()
                    if flag in ("true", "1", "yes", "on", "false", "0", "no", "off"):
                        return flag in ("true", "1", "yes", "on")
                else:
                    return loads(value)
            except ValueError:
                pass
        try:
            return loads(value)
        except ValueError:
            return value


def _unquoted(text: str) -> str:
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    return text


def _schema_types(schema: Any, depth: int = 0) -> set[str]:
    """The JSON types a parameter's schema allows: its ``type`` (a name or a list), its ``enum``'s
    values' types, and those of its ``anyOf`` / ``oneOf`` / ``allOf`` choices."""
    if not isinstance(schema, Mapping) or depth > 32:
        return set()
    kind = schema.get("type")
    kinds = (
        {kind}
        if isinstance(kind, str)
        else {k for k in kind if isinstance(k, str)}
        if isinstance(kind, list)
        else set()
    )
    enum = schema.get("enum")
    if isinstance(enum, list):
        kinds |= {_JSON_TYPES.get(type(value), "string") for value in enum}
    for key in ("anyOf", "oneOf", "allOf"):
        choices = schema.get(key)
        for choice in choices if isinstance(choices, list) else ():
            kinds |= _schema_types(choice, depth + 1)
    return kinds


_JSON_TYPES = {
    type(None): "null",
    bool: "boolean",
    int: "integer",
    float: "number",
    list: "array",
    dict: "object",
}
