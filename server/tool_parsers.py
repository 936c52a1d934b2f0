"""Tool-call parsers: a model's own way of writing tool calls, read back as OpenAI ``tool_calls``.

With ``tool_choice="auto"`` the model decides whether to call a tool and writes the call in the
format it was trained on; ``--tool-call-parser`` names that format, as in vLLM:

* ``hermes`` (Hermes 2/3, Qwen2.5, QwQ, Qwen3): ``<tool_call>{"name": …, "arguments": {…}}</tool_call>``,
  any number, after optional text;
* ``llama3_json`` (Llama 3.1-3.3): the whole answer is ``{"name": …, "parameters": {…}}`` (or
  several separated by ``;``), optionally after ``<|python_tag|>``;
* ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name": …, "arguments": {…}}``;
* ``deepseek_v3`` (DeepSeek-V3, R1): a ``<｜tool▁calls▁begin｜>`` section of
  ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` + a fenced JSON block + ``<｜tool▁call▁end｜>``;
* ``deepseek_v31`` (DeepSeek-V3.1): the same section, each call ``NAME<｜tool▁sep｜>{…}``;
* ``kimi_k2``: a ``<|tool_calls_section_begin|>`` section of ``<|tool_call_begin|>functions.NAME:i``
  + ``<|tool_call_argument_begin|>{…}<|tool_call_end|>``;
* ``pythonic`` (Llama 3.2, Llama 4, ToolACE; ``llama4_pythonic`` the same): the whole answer is a
  Python list of calls with literal keyword arguments, ``[get_weather(city="Paris"), now()]``,
  optionally inside ``<|python_start|>`` … ``<|python_end|>``;
* ``granite`` (Granite 3.x): the whole answer is ``<|tool_call|>`` (or ``<tool_call>``) then a JSON
  array of ``{"name": …, "arguments": {…}}``;
* ``phi4_mini_json`` (Phi-4-mini): the whole answer is ``functools[`` + calls as JSON objects + ``]``;
* ``qwen3_coder`` (Qwen3-Coder): ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>…
  </function></tool_call>``, any number, after optional text; values are text, typed by the
  request's tool schema (``for_tools``: integers, numbers, booleans, objects and arrays decoded,
  strings kept as written);
* ``glm45`` (GLM-4.5/4.6): ``<tool_call>NAME`` then ``<arg_key>K</arg_key><arg_value>V</arg_value>``
  pairs and ``</tool_call>``, values typed as ``qwen3_coder``'s.

A parser never loses text: anything that is not a well-formed call stays content. Streaming goes
through a ``ToolStreamer``, whose result does not depend on how the text was cut into deltas
(content is released as soon as it cannot be the start of a call; a call is released whole when it
is complete), so a replica resuming a stream (router failover) rebuilds the same state by feeding
it the text already delivered.
"""

from __future__ import annotations

import ast
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # the arguments object as JSON text


def call_from(obj: Any, argument_keys: tuple[str, ...] = ("arguments", "parameters")) -> ParsedCall | None:
    """A call from a decoded ``{"name": …, "arguments": {…}}`` object, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: Any = {}
    for key in argument_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_values(text: str, separators: str = "") -> list[Any] | None:
    """Every JSON value in ``text`` (separated by whitespace and ``separators``), or None if any
    part of it is not JSON."""
    decoder = json.JSONDecoder()
    values, pos = [], 0
    skip = " \t\r\n" + separators
    while True:
        while pos < len(text) and text[pos] in skip:
            pos += 1
        if pos == len(text):
            return values
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        values.append(value)


class ToolParser(ABC):
    name: ClassVar[str]
    # The call marker is a special token (dropped from text unless special tokens are kept).
    needs_special_tokens: ClassVar[bool] = False

    def for_tools(self, tools: Sequence[Any]) -> ToolParser:
        """The parser for one request's tools (validated tool definitions): itself, unless its
        format needs their schemas to read calls."""
        return self

    @abstractmethod
    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        """(content, calls) of a whole answer; content is ``text`` itself when no call is read."""

    @abstractmethod
    def streamer(self) -> ToolStreamer: ...


class ToolStreamer(ABC):
    @abstractmethod
    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        """Content to send now and calls completed by this delta."""

    @abstractmethod
    def finish(self) -> tuple[str, list[ParsedCall]]:
        """What is still held back, at the end of the answer."""


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class MarkerStreamer(ToolStreamer):
    """Content until ``start``; then a call body up to ``end`` (or to the end of the answer when
    ``end`` is None), read by ``read_body`` into calls; then content again. Whitespace between or
    after calls is sent only if more content follows it."""

    def __init__(self, start: str, end: str | None, read_body) -> None:
        self.start, self.end, self.read_body = start, end, read_body
        self.pending = ""  # content held back: it may be the start of ``start``
        self.body: str | None = None  # inside a call: its text so far
        self.spaces = ""  # whitespace after a call
        self.called = False

    def _content(self, text: str) -> str:
        if self.called and not (self.spaces + text).strip():
            self.spaces += text
            return ""
        text, self.spaces = self.spaces + text, ""
        return text

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        out: list[str] = []
        calls: list[ParsedCall] = []
        self.pending += text
        while self.pending:
            if self.body is None:
                at = self.pending.find(self.start)
                if at < 0:
                    cut = len(self.pending) - held_prefix(self.pending, self.start)
                    out.append(self._content(self.pending[:cut]))
                    self.pending = self.pending[cut:]
                    break
                out.append(self._content(self.pending[:at]))
                self.body, self.pending = "", self.pending[at + len(self.start) :]
                continue
            self.body += self.pending
            self.pending = ""
            if self.end is None or self.end not in self.body:
                break
            at = self.body.index(self.end)
            body, rest = self.body[:at], self.body[at + len(self.end) :]
            read = self.read_body(body)
            if read is None:  # not a call after all: it stays text
                out.append(self._content(self.start + body + self.end))
            else:
                calls += read
                self.called = True
            self.body, self.pending = None, rest
        return "".join(out), calls

    def finish(self) -> tuple[str, list[ParsedCall]]:
        if self.body is None:
            content, self.pending = self.pending, ""
            return self._content(content), []
        body, self.body = self.body, None
        read = self.read_body(body)
        if read is None:
            return self._content(self.start + body), []
        return "", read


def _parse_by_streaming(parser: ToolParser, text: str) -> tuple[str, list[ParsedCall]]:
    """A whole answer read as one delta: the same result as streaming it, by construction."""
    streamer = parser.streamer()
    content, calls = streamer.feed(text)
    more, last = streamer.finish()
    return (content + more, calls + last) if calls or last else (text, [])


class HermesParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    @staticmethod
    def _read(body: str) -> list[ParsedCall] | None:
        values = _json_values(body)
        if not values:
            return None
        calls = [call_from(v) for v in values]
        return None if any(c is None for c in calls) else calls  # type: ignore[return-value]

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        return _parse_by_streaming(self, text)

    def streamer(self) -> ToolStreamer:
        return MarkerStreamer(self.START, self.END, self._read)


class MistralParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True
    START = "[TOOL_CALLS]"

    @staticmethod
    def _read(body: str) -> list[ParsedCall] | None:
        values = _json_values(body)
        if not values:
            return None
        items = [x for v in values for x in (v if isinstance(v, list) else [v])]
        calls = [call_from(v) for v in items]
        return None if not calls or any(c is None for c in calls) else calls  # type: ignore[return-value]

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        streamer = self.streamer()
        content, _ = streamer.feed(text)
        more, calls = streamer.finish()
        return (content + more, calls) if calls else (text, [])

    def streamer(self) -> ToolStreamer:
        return MarkerStreamer(self.START, None, self._read)


class SectionParser(ToolParser):
    """Calls inside one section of special tokens: ``SECTION_START`` (call)+ ``SECTION_END``, each
    call ``CALL_START`` … ``CALL_END`` read by ``read_call``. Only whitespace may separate calls; a
    section cut off at the end of the answer keeps the calls that are complete in it."""

    needs_special_tokens = True
    SECTION_START: ClassVar[str]
    SECTION_END: ClassVar[str]
    CALL_START: ClassVar[str]
    CALL_END: ClassVar[str]

    @abstractmethod
    def read_call(self, inner: str) -> ParsedCall | None:
        """The call written between CALL_START and CALL_END, or None if it is not one."""

    def _read(self, body: str) -> list[ParsedCall] | None:
        calls: list[ParsedCall] = []
        rest = body.strip()
        while rest:
            if not rest.startswith(self.CALL_START):
                return None
            inner, found, rest = rest[len(self.CALL_START) :].partition(self.CALL_END)
            call = self.read_call(inner)
            if call is None:
                return None
            calls.append(call)
            if not found:  # cut off after a complete call body
                break
            rest = rest.strip()
        return calls or None

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        return _parse_by_streaming(self, text)

    def streamer(self) -> ToolStreamer:
        return MarkerStreamer(self.SECTION_START, self.SECTION_END, self._read)


def _json_object(text: str) -> str | None:
    """``text`` as compact-spaced JSON if it is exactly one JSON object, else None."""
    values = _json_values(text)
    if values is None or len(values) != 1 or not isinstance(values[0], dict):
        return None
    return json.dumps(values[0], ensure_ascii=False)


class DeepSeekV3Parser(SectionParser):
    name = "deepseek_v3"
    SECTION_START, SECTION_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL_START, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"

    def read_call(self, inner: str) -> ParsedCall | None:
        kind, found, rest = inner.partition(self.SEP)
        name, _, block = rest.partition("\n")
        block = block.strip()
        if not found or kind.strip() != "function" or not name.strip():
            return None
        if not (block.startswith("```json") and block.endswith("```")) or len(block) < 10:
            return None
        args = _json_object(block[len("```json") : -3])
        return None if args is None else ParsedCall(name.strip(), args)


class DeepSeekV31Parser(DeepSeekV3Parser):
    name = "deepseek_v31"

    def read_call(self, inner: str) -> ParsedCall | None:
        name, found, rest = inner.partition(self.SEP)
        args = _json_object(rest) if found and name.strip() else None
        return None if args is None else ParsedCall(name.strip(), args)


class KimiK2Parser(SectionParser):
    name = "kimi_k2"
    SECTION_START, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    CALL_START, CALL_END, ARGS = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"

    def read_call(self, inner: str) -> ParsedCall | None:
        call_id, found, rest = inner.partition(self.ARGS)
        # The id is "functions.NAME:INDEX".
        name = call_id.strip().removeprefix("functions.").rpartition(":")[0]
        args = _json_object(rest) if found and name else None
        return None if args is None else ParsedCall(name, args)


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
        values = _json_values(body, separators=";")
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
        self.text = ""
        self.holding: bool | None = None  # None: not decided yet

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        if self.holding is False:
            return text, []
        self.text += text
        head = self.text.lstrip()
        if not head:
            return "", []
        openers = self.parser.OPENERS
        if any(head.startswith(o) for o in openers):
            self.holding = True
            return "", []
        if any(o.startswith(head) for o in openers):
            return "", []  # could still become an opener
        self.holding = False
        content, self.text = self.text, ""
        return content, []

    def finish(self) -> tuple[str, list[ParsedCall]]:
        if self.holding is False:
            return "", []
        text, self.text = self.text, ""
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
    values = _json_values(text)
    if values is None or len(values) != 1 or not isinstance(values[0], list) or not values[0]:
        return None
    calls = [call_from(v) for v in values[0]]
    return None if any(c is None for c in calls) else calls  # type: ignore[return-value]


class TypedArgumentsParser(ToolParser):
    """Formats that write each argument as text: typed by the request's tool schemas."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, types: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self.types = types or {}  # function -> parameter -> its JSON schema type

    def for_tools(self, tools: Sequence[Any]) -> ToolParser:
        types = {}
        for tool in tools:
            props = (tool.function.parameters or {}).get("properties") or {}
            types[tool.function.name] = {k: v.get("type") for k, v in props.items() if isinstance(v, Mapping)}
        return type(self)(types)

    @abstractmethod
    def read_call(self, body: str) -> tuple[str, list[tuple[str, str]]] | None:
        """(function name, [(parameter, its text)]) of one call's body, or None if it is not one."""

    def _read(self, body: str) -> list[ParsedCall] | None:
        read = self.read_call(body)
        if read is None:
            return None
        name, pairs = read
        types = self.types.get(name, {})
        args = {key: _typed(value, types.get(key)) for key, value in pairs}
        return [ParsedCall(name, json.dumps(args, ensure_ascii=False))]

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        return _parse_by_streaming(self, text)

    def streamer(self) -> ToolStreamer:
        return MarkerStreamer(self.START, self.END, self._read)


class Glm45Parser(TypedArgumentsParser):
    name = "glm45"
    _PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)(?:</arg_value>|$)", re.S)
    _NAME = re.compile(r"[\w.\-]+")

    def read_call(self, body: str) -> tuple[str, list[tuple[str, str]]] | None:
        name = body.strip().partition("\n")[0].split("<arg_key>", 1)[0].strip()
        if not self._NAME.fullmatch(name):
            return None
        return name, [(k.strip(), v.strip()) for k, v in self._PAIR.findall(body)]


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


def _typed(value: str, kind: Any) -> Any:
    """A parameter's text as its schema's type says (strings as written; JSON text decoded when the
    type is not known, else kept as a string)."""
    if kind == "string" or (isinstance(kind, list) and "string" in kind):
        return value
    try:
        decoded = json.loads(value)
    except ValueError:
        return value
    if kind == "integer" and isinstance(decoded, float) and decoded.is_integer():
        return int(decoded)
    return decoded


# The formats whose whole answer is the call (held from their first characters: _WholeAnswerStreamer).
WholeAnswerParser = Llama3JsonParser | PythonicParser | GraniteParser | Phi4MiniJsonParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p
    for p in (
        HermesParser,
        Llama3JsonParser,
        MistralParser,
        DeepSeekV3Parser,
        DeepSeekV31Parser,
        KimiK2Parser,
        PythonicParser,
        Llama4PythonicParser,
        GraniteParser,
        Phi4MiniJsonParser,
        Qwen3CoderParser,
        Glm45Parser,
    )
}


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"unknown tool-call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}"
        ) from None
