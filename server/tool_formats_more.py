"""More tool-call formats, each on a base of ``server/tool_parser_base.py`` or ``server/tool_formats.py``:
Step-3's and DeepSeek-V3.2's XML-like sections, Olmo 3's newline-separated Python calls, and the
formats that mark where a call starts and read it to the end of the answer (granite-20b-fc,
GigaChat 3) or between their own tokens (FunctionGemma); and vLLM's names for Qwen3-Coder's format
that MiMo and Step-3.5 write. Registered in ``server/tool_parsers.py``,
which lists every format.
"""

from __future__ import annotations

import math
import re
from abc import abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from server.tool_formats import Qwen3CoderParser, TypedArgumentsParser, WholeAnswerStreamer, python_calls
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
    _PARAMETER = re.compile(r'<steptml:parameter name="([^"]+)">([^<]*)</steptml:parameter>')

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
    literal values, JSON's ``null`` / ``true`` / ``false`` too) then ``</function_calls>``."""

    name = "olmo3"
    TAG, END_TAG = "<function_calls>", "</function_calls>"
    OPENERS: ClassVar[tuple[str, ...]] = (TAG,)
    NAMES: ClassVar[Mapping[str, Any]] = {"null": None, "true": True, "false": False}

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        body = text.strip()
        if not body.startswith(self.TAG):
            return text, []
        body = body[len(self.TAG) :].removesuffix(self.END_TAG)
        lines = [line.strip() for line in body.splitlines() if line.strip()]
        calls = python_calls(f"[{', '.join(lines)}]", self.NAMES) if lines else None
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
        calls = []
        for part in body.split(self.START):
            values = json_values(part)
            call = call_from(values[0], ("arguments",)) if values and len(values) == 1 else None
            if call is None:
                return None
            calls.append(call)
        return calls


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
        values = json_values(body[len(self.HEADER) :].rstrip().removesuffix(self.EOS))
        if not values or len(values) != 1 or not isinstance(values[0], dict):
            return None
        call = call_from(values[0], ("arguments",)) if "arguments" in values[0] else None
        return None if call is None else [call]


class FunctionGemmaParser(MarkedCallParser):
    """FunctionGemma: ``<start_function_call>call:NAME{KEY:<escape>VALUE<escape>,…}<end_function_call>``,
    any number, after optional text; each value JSON where it reads as JSON, else text."""

    name = "functiongemma"
    needs_special_tokens = True
    START, END = "<start_function_call>", "<end_function_call>"
    _CALL = re.compile(r"\s*call:(\w+)\{(.*?)\}?\s*", re.S)
    _ARGUMENT = re.compile(r"(\w+):<escape>(.*?)<escape>", re.S)

    def read_body(self, body: str) -> list[ParsedCall] | None:
        m = self._CALL.fullmatch(body)
        if m is None:
            return None
        arguments = dumps({k: _json_or_text(v) for k, v in self._ARGUMENT.findall(m[2])})
        return None if arguments is None else [ParsedCall(m[1], arguments)]


class MimoParser(Qwen3CoderParser):
    name = "mimo"  # MiMo: Qwen3-Coder's calls (vLLM reads both with one parser)


class Step3p5Parser(Qwen3CoderParser):
    name = "step3p5"  # Step-3.5: Qwen3-Coder's calls
