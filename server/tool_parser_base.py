"""What every tool-call parser is built from: the parsed call, the parser and streamer interfaces,
and the streamer of formats that mark a call's start (and end) with fixed text.

A parser never loses text: anything that is not a well-formed call stays content. Streaming goes
through a ``ToolStreamer``, whose result does not depend on how the text was cut into deltas
(content is released as soon as it cannot be the start of a call; a call is released whole when it
is complete), so a replica resuming a stream (router failover) rebuilds the same state by feeding
it the text already delivered. The formats: ``server/tool_parsers.py`` (and its registry),
``server/tool_formats.py``, ``server/tool_formats_typed.py``, ``server/tool_formats_more.py``.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # the arguments object as JSON text
    # The call's id where the model writes one (Kimi-K2's ``functions.NAME:i``): its chat template
    # renders the id back into the history, so it must come back unchanged. None: the server makes one.
    id: str | None = None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def loads(text: str) -> Any:
    """``json.loads``; JSON nested deeper than Python's stack allows (a model looping on ``[``) is
    a ValueError like any other text that is not JSON, never a failed request."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deep") from None


def dumps(value: Any) -> str | None:
    """``value`` as JSON text (non-ASCII kept), or None where it nests too deep to write."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except RecursionError:
        return None


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
            args = loads(args)
        except ValueError:
            return None
    arguments = dumps(args) if isinstance(args, dict) else None
    return None if arguments is None else ParsedCall(obj["name"], arguments)


def json_values(text: str, separators: str = "", strict: bool = True) -> list[Any] | None:
    """Every JSON value in ``text`` (separated by whitespace and ``separators``), or None if any
    part of it is not JSON (``strict`` False: strings may hold raw control characters, such as the
    newlines of a multi-line argument some models write unescaped)."""
    decoder = json.JSONDecoder(strict=strict)
    values, pos = [], 0
    skip = " \t\r\n" + separators
    while True:
        while pos < len(text) and text[pos] in skip:
            pos += 1
        if pos == len(text):
            return values
        try:
            value, pos = decoder.raw_decode(text, pos)
        except (ValueError, RecursionError):
            return None
        values.append(value)


class ToolParser(ABC):
    name: ClassVar[str]
    # The call marker is a special token (dropped from text unless special tokens are kept).
    needs_special_tokens: ClassVar[bool] = False

    def new_call_id(self) -> str:
        """An id for a call the model wrote without one."""
        return new_call_id()

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

    @property
    @abstractmethod
    def held(self) -> int:
        """How many of the last characters fed are held back, not yet sent nor taken for a call:
        the rest are decided (``server/text_logprobs.py`` gives content its tokens' logprobs by it)."""

    def pieces(self, text: str) -> list[tuple[str, list[ParsedCall]]]:
        """``feed`` in the order written: (content, the calls that follow it) pieces, more than one
        when text follows a call in the same delta (several tokens at once)."""
        return [self.feed(text)]


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class MarkerStreamer(ToolStreamer):
    """Content until ``start``; then a call body up to ``end`` (or to the end of the answer when
    ``end`` is None), read by ``read_body`` into calls; then content again. Whitespace right after a
    call is sent only if text follows it (not another call, nor the end); once text follows, its
    whitespace is text."""

    def __init__(self, start: str, end: str | None, read_body) -> None:
        self.start, self.end, self.read_body = start, end, read_body
        self.pending = ""  # content held back: it may be the start of ``start``
        # Inside a call: its text so far, in pieces (joined once, at its end: a call's arguments may
        # be a whole file written a few characters a delta) ...
        self.body: list[str] | None = None
        self.body_size = 0  # its length
        self.tail = ""  # ... and its last characters, which may be the first ones of ``end``
        self.spaces = ""  # whitespace after a call
        self.called = False  # a call ended and no text has followed it yet

    @property
    def held(self) -> int:
        call = len(self.start) + self.body_size if self.body is not None else 0
        return len(self.spaces) + call + len(self.pending)

    def _content(self, text: str) -> str:
        if self.called and not (self.spaces + text).strip():
            self.spaces += text
            return ""
        text, self.spaces = self.spaces + text, ""
        # The text's own whitespace (before the next call, or at the end) is then sent as it comes,
        # as a whole answer read in one piece sends it.
        self.called = False
        return text

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        pieces = self.pieces(text)
        return "".join(content for content, _ in pieces), [c for _, calls in pieces for c in calls]

    def pieces(self, text: str) -> list[tuple[str, list[ParsedCall]]]:
        done: list[tuple[str, list[ParsedCall]]] = []
        out: list[str] = []  # the content since the last call
        self.pending += text
        while self.pending:
            if self.body is None:
                at = self.pending.find(self.start)
                if at < 0:
                    cut = len(self.pending) - held_prefix(self.pending, self.start)
                    out.append(self._content(self.pending[:cut]))
                    self.pending = self.pending[cut:]
                    break
                before = self.pending[:at]
                if self.called and not (self.spaces + before).strip():
                    self.spaces += before  # whitespace alone before a call: dropped if it is one
                else:
                    out.append(self._content(before))
                self.body, self.body_size, self.tail = [], 0, ""
                self.pending = self.pending[at + len(self.start) :]
                continue
            piece, self.pending = self.pending, ""
            window = self.tail + piece  # the body's text where ``end`` may be, seen for the first time
            at = -1 if self.end is None else window.find(self.end)
            if at < 0:
                self.body.append(piece)
                self.body_size += len(piece)
                if self.end is not None:
                    self.tail = window[max(0, len(window) - len(self.end) + 1) :]
                break
            whole = "".join(self.body) + piece
            at += len(whole) - len(window)
            body, rest = whole[:at], whole[at + len(self.end) :]
            read = self.read_body(body)
            if read is None:  # not a call after all: it stays text
                out.append(self._content(self.start + body + self.end))
            else:
                done.append(("".join(out), read))
                out = []
                self.called, self.spaces = True, ""  # whitespace between two calls is neither's
            self.body, self.tail, self.pending = None, "", rest
        content = "".join(out)
        if content or not done:
            done.append((content, []))
        return done

    def finish(self) -> tuple[str, list[ParsedCall]]:
        if self.body is None:
            content, self.pending = self.pending, ""
            return self._content(content), []
        body, self.body = "".join(self.body), None
        read = self.read_body(body)
        if read is None:
            return self._content(self.start + body), []
        return "", read


def parse_by_streaming(parser: ToolParser, text: str) -> tuple[str, list[ParsedCall]]:
    """A whole answer read as one delta: the same result as streaming it, by construction."""
    streamer = parser.streamer()
    content, calls = streamer.feed(text)
    more, last = streamer.finish()
    return (content + more, calls + last) if calls or last else (text, [])


class MarkedCallParser(ToolParser):
    """Calls between ``START`` and ``END`` markers, after optional text and between text: each
    marked body read by ``read_body`` into calls (None: not a call after all, so it stays text)."""

    START: ClassVar[str]
    END: ClassVar[str]

    @abstractmethod
    def read_body(self, body: str) -> list[ParsedCall] | None: ...

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        return parse_by_streaming(self, text)

    def streamer(self) -> ToolStreamer:
        return MarkerStreamer(self.START, self.END, self.read_body)
