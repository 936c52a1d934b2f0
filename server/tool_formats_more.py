"""More tool-call formats, each on a base of ``server/tool_parser_base.py``, ``server/tool_formats.py``
or ``server/tool_formats_typed.py``: Step-3's and DeepSeek-V3.2's XML-like sections, Olmo 3's
newline-separated Python calls, and the formats that mark where a call starts and read it to the end
of the answer (granite-20b-fc, GigaChat 3) or between their own tokens (FunctionGemma); and vLLM's
names for Qwen3-Coder's format that MiMo and Step-3.5 write. Registered in
``server/tool_parsers.py``, which lists every format.
"""

from __future__ import annotations

import json
import math
import re
from abc import abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from server.tool_formats import WholeAnswerStreamer, python_call_lines
from server.tool_formats_typed import Qwen3CoderParser, TypedArgumentsParser
from server.tool_parser_base import (
    MarkedCallParser,
    MarkerStreamer,
    ParsedCall,
    ToolParser,
    ToolStreamer,
    call_from,
    dumps,
    json_values,
    loads,
    parse_by_streaming,
)


def _calls_in_section(
    body: str, begin: str, end: str, read: Callable[[str], list[ParsedCall] | None]
) -> list[ParsedCall] | None:
    """The calls of a section of ``begin`` … ``end`` calls (only whitespace between them), each read
    by ``read``; one cut off at the end of the answer keeps the complete calls before it."""
    calls: list[ParsedCall] = []
    rest = body.strip()
    while rest:
        if not rest.startswith(begin):
            return None
        inner, found, rest = rest[len(begin) :].partition(end)
        if not found:
            break  # cut off inside a call: the complete ones before it are kept
        read_calls = read(inner)
        if read_calls is None:
            return None
        calls += read_calls
        rest = rest.strip()
    return calls or None


class Step3Parser(TypedArgumentsParser):
    """Step-3: a ``<｜tool_calls_begin｜>`` section of ``<｜tool_call_begin｜>function<｜tool_sep｜>``
    + ``<steptml:invoke name="NAME">`` with ``<steptml:parameter name="KEY">VALUE</steptml:parameter>``
    each + ``</steptml:invoke><｜tool_call_end｜>``; values typed by the tool's schema (``typed``)."""

    name = "step3"
    needs_special_tokens = True
    START, END = "<｜tool_calls_begin｜>", "<｜tool_calls_end｜>"
    CALL_BEGIN, CALL_END, SEP = "<｜tool_call_begin｜>", "<｜tool_call_end｜>", "<｜tool_sep｜>"
    _INVOKE = re.compile(r'\s*<steptml:invoke name="([^"]+)">(.*?)(?:</steptml:invoke>\s*)?$', re.S)
    # A value is everything up to its closing tag (code or markup in it, ``a < b``, is the value's),
    # never another parameter's opening.
    _PARAMETER = re.compile(
        r'<steptml:parameter name="([^"]+)">((?:(?!<steptml:parameter ).)*?)</steptml:parameter>', re.S
    )

    def read_call(self, body: str) -> tuple[str, list[tuple[str, str]]] | None:
        kind, found, invoke = body.partition(self.SEP)
        m = self._INVOKE.match(invoke) if found and kind.strip() == "function" else None
        if m is None:
            return None
        return m.group(1), [(k, v.strip()) for k, v in self._PARAMETER.findall(m.group(2))]

    def read_body(self, body: str) -> list[ParsedCall] | None:
        return _calls_in_section(body, self.CALL_BEGIN, self.CALL_END, super().read_body)

    @staticmethod
    def typed(value: str, schema: Mapping[str, Any] | None) -> Any:
        """By the declared type, as vLLM's step3 parser casts: ``integer``, ``number`` (a float),
        ``boolean`` (``true`` / ``false``), ``null``; text that does not read as its type, and anything
        else (undeclared parameters too), stays text."""
        kind = None if schema is None else schema.get("type")
        try:
            if kind == "integer":
                return int(value)
            if kind == "number":
                number = float(value)
                return number if math.isfinite(number) else value
        except ValueError:
            return value
        if kind == "boolean" and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if kind == "null" and value.lower() == "null":
            return None
        return value


class DeepSeekV32Parser(MarkedCallParser):
    """DeepSeek-V3.2 (DSML): ``<｜DSML｜function_calls>`` then one or more ``<｜DSML｜invoke
    name="NAME">`` with ``<｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>``
    each and ``</｜DSML｜invoke>``, then ``</｜DSML｜function_calls>``. ``string="true"`` values are text
    as written; the others are JSON (kept as text where they are not)."""

    name = "deepseek_v32"
    START, END = "<｜DSML｜function_calls>", "</｜DSML｜function_calls>"
    _INVOKE = re.compile(r'\s*<｜DSML｜invoke\s+name="([^"]+)"\s*>(.*?)</｜DSML｜invoke>\s*', re.S)
    _PARAMETER = re.compile(
        r'<｜DSML｜parameter\s+name="([^"]+)"\s+string="(true|false)"\s*>(.*?)</｜DSML｜parameter>', re.S
    )

    def read_body(self, body: str) -> list[ParsedCall] | None:
        calls: list[ParsedCall] = []
        pos = 0
        for m in self._INVOKE.finditer(body):
            if m.start() != pos:
                return None
            pos = m.end()
            args = {
                k: v if text == "true" else _json_or_text(v) for k, text, v in self._PARAMETER.findall(m[2])
            }
            arguments = dumps(args)
            if arguments is None:
                return None
            calls.append(ParsedCall(m[1], arguments))
        rest = body[pos:].lstrip()
        if not calls or (rest and not rest.startswith("<｜DSML｜invoke")):
            return None  # not calls, or text after them (a call cut off at the end is dropped)
        return calls


def _json_or_text(value: str) -> Any:
    try:
        decoded = loads(value)
    except ValueError:
        return value
    return value if isinstance(decoded, float) and not math.isfinite(decoded) else decoded


class Olmo3Parser(ToolParser):
    """Olmo 3: the whole answer is ``<function_calls>`` then one Python call a line (keyword arguments,
    literal values, JSON's ``null`` / ``true`` / ``false`` too) then ``</function_calls>``; read as
    Python reads statements, so a call over several lines or a string holding a newline is kept whole."""

    name = "olmo3"
    TAG, END_TAG = "<function_calls>", "</function_calls>"
    OPENERS: ClassVar[tuple[str, ...]] = (TAG,)
    NAMES: ClassVar[Mapping[str, Any]] = {"null": None, "true": True, "false": False}

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        body = text.strip()
        if not body.startswith(self.TAG):
            return text, []
        body = body[len(self.TAG) :].removesuffix(self.END_TAG)
        calls = python_call_lines(body.strip(), self.NAMES)
        if calls is None:  # indented lines: read one call a line
            lines = [line.strip() for line in body.splitlines() if line.strip()]
            calls = python_call_lines("\n".join(lines), self.NAMES)
        return ("", calls) if calls else (text, [])

    def streamer(self) -> ToolStreamer:
        return WholeAnswerStreamer(self)  # type: ignore[arg-type]


class ReadToEndParser(ToolParser):
    """Calls from ``START`` to the end of the answer, after optional text: the body read by
    ``read_body`` (None: not calls, all of it stays text)."""

    START: ClassVar[str]

    @abstractmethod
    def read_body(self, body: str) -> list[ParsedCall] | None: ...

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        return parse_by_streaming(self, text)

    def streamer(self) -> ToolStreamer:
        return MarkerStreamer(self.START, None, self.read_body)


class Granite20bFCParser(ReadToEndParser):
    """granite-20b-functioncalling: ``<function_call>`` then ``{"name": …, "arguments": {…}}``, one or
    more, to the end of the answer."""

    name = "granite-20b-fc"
    START = "<function_call>"

    def read_body(self, body: str) -> list[ParsedCall] | None:
        """Each call's JSON read where it starts, so ``<function_call>`` inside an argument is text."""
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while True:
            try:
                value, pos = decoder.raw_decode(body, len(body) - len(body[pos:].lstrip()))
            except (ValueError, RecursionError):
                return None
            call = call_from(value, ("arguments",))
            if call is None:
                return None
            calls.append(call)
            rest = body[pos:].lstrip()
            if not rest:
                return calls
            if not rest.startswith(self.START):
                return None
            pos = len(body) - len(rest) + len(self.START)


class GigaChat3Parser(ReadToEndParser):
    """GigaChat 3: the answer's text, then ``<|message_sep|>`` and ``function call<|role_sep|>`` then
    one ``{"name": …, "arguments": {…}}`` (maybe followed by ``</s>``) to the end of the answer."""

    name = "gigachat3"
    needs_special_tokens = True
    START, HEADER, EOS = "<|message_sep|>", "function call<|role_sep|>", "</s>"

    def read_body(self, body: str) -> list[ParsedCall] | None:
        body = body.lstrip()
        if not body.startswith(self.HEADER):
            return None
        # Read leniently, as vLLM reads GigaChat's calls: a string may hold raw newlines.
        values = json_values(body[len(self.HEADER) :].rstrip().removesuffix(self.EOS), strict=False)
        if not values or len(values) != 1 or not isinstance(values[0], dict):
            return None
        call = call_from(values[0], ("arguments",)) if "arguments" in values[0] else None
        return None if call is None else [call]


class FunctionGemmaParser(MarkedCallParser):
    """FunctionGemma: ``<start_function_call>call:NAME{KEY:VALUE,…}<end_function_call>``, any number,
    after optional text. As its chat template writes them, strings are between ``<escape>`` tokens
    (each read as JSON where it reads as JSON, as vLLM reads them, else text), objects ``{…}`` and
    lists ``[…]`` hold values the same way, and anything else is raw (``3``, ``true``, ``null``: JSON,
    else text). A call cut off at the end of the answer keeps its arguments complete before the cut."""

    name = "functiongemma"
    needs_special_tokens = True
    START, END = "<start_function_call>", "<end_function_call>"
    _CALL = re.compile(r"\s*call:([\w.\-]+)\{", re.S)

    def read_body(self, body: str) -> list[ParsedCall] | None:
        m = self._CALL.match(body)
        if m is None:
            return None
        args: dict[str, Any] = {}
        try:
            end = _GemmaReader(body).items(m.end(), args, "}", 0)
        except _CutOff:
            end = len(body)  # the answer ended inside the call: the arguments complete before it
        except ValueError:
            return None
        arguments = dumps(args) if not body[end:].strip() else None
        return None if arguments is None else [ParsedCall(m[1], arguments)]


class _CutOff(Exception):
    """The text ended inside a value."""


class _GemmaReader:
    """FunctionGemma's values, read from ``text``: each method takes the position where its part
    starts and returns (what it read and) the position after it; ValueError where the text is not
    that syntax, ``_CutOff`` where it ends first."""

    ESCAPE = "<escape>"
    RAW_END = re.compile(r"[,}\]]")
    KEY = re.compile(r"[^:,{}\[\]<>]+")
    MAX_DEPTH = 64  # objects and lists nested deeper are not a call's arguments

    def __init__(self, text: str) -> None:
        self.text = text

    def items(self, pos: int, into: dict[str, Any] | list[Any], close: str, depth: int) -> int:
        """An object's ``KEY:VALUE`` pairs (``into`` a dict) or a list's values, up to ``close``;
        each item is added to ``into`` once it is complete."""
        if depth > self.MAX_DEPTH:
            raise ValueError("nested too deep")
        text, first = self.text, True
        while True:
            pos = self._skip(pos)
            if text[pos] == close:
                return pos + 1
            if not first:
                if text[pos] != ",":
                    raise ValueError("expected ','")
                pos = self._skip(pos + 1)
                if text[pos] == close:  # a trailing comma
                    return pos + 1
            first = False
            if isinstance(into, dict):
                key, pos = self._key(pos)
                pos = self._skip(pos)
                if text[pos] != ":":
                    raise ValueError("expected ':'")
                into[key], pos = self.value(self._skip(pos + 1), depth)
            else:
                value, pos = self.value(pos, depth)
                into.append(value)

    def value(self, pos: int, depth: int) -> tuple[Any, int]:
        text = self.text
        if text.startswith(self.ESCAPE, pos):
            string, pos = self._escaped(pos)
            return _json_or_text(string), pos
        if text[pos] in "{[":
            into: dict[str, Any] | list[Any] = {} if text[pos] == "{" else []
            return into, self.items(pos + 1, into, "}" if text[pos] == "{" else "]", depth + 1)
        m = self.RAW_END.search(text, pos)
        if m is None:
            raise _CutOff  # a raw value may go on
        raw = text[pos : m.start()].strip()
        if not raw:
            raise ValueError("a value is missing")
        return _json_or_text(raw), m.start()

    def _key(self, pos: int) -> tuple[str, int]:
        if self.text.startswith(self.ESCAPE, pos):
            return self._escaped(pos)
        m = self.KEY.match(self.text, pos)
        if m is None or not m.group().strip():
            raise ValueError("a key is missing")
        if m.end() == len(self.text):
            raise _CutOff
        return m.group().strip(), m.end()

    def _escaped(self, pos: int) -> tuple[str, int]:
        start = pos + len(self.ESCAPE)
        end = self.text.find(self.ESCAPE, start)
        if end < 0:
            raise _CutOff
        return self.text[start:end], end + len(self.ESCAPE)

    def _skip(self, pos: int) -> int:
        """The position of the next character that is not whitespace (_CutOff at the end)."""
        while pos < len(self.text) and self.text[pos].isspace():
            pos += 1
        left = len(self.text) - pos
        if left == 0 or (left < len(self.ESCAPE) and self.ESCAPE.startswith(self.text[pos:])):
            raise _CutOff  # nothing more, or an <escape> cut off
        return pos


class MimoParser(Qwen3CoderParser):
    name = "mimo"  # MiMo: Qwen3-Coder's calls (vLLM reads both with one parser)


class Step3p5Parser(Qwen3CoderParser):
    name = "step3p5"  # Step-3.5: Qwen3-Coder's calls
