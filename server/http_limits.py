"""uvicorn's HTTP/1.1 protocols with the limits a server facing clients needs; ``ferry serve`` and
``ferry router`` both run these (``uvicorn.Config(**uvicorn_options(limits))``).

uvicorn times out only an idle keep-alive connection, after an answer. What it leaves to the client:

* how long a request may take to arrive: a client that connects and sends nothing, or sends its
  headers a byte every few seconds (slowloris), or a body that trickles, holds a connection (and a
  task waiting for the body) for ever. Here the headers must arrive within ``header_timeout``
  seconds of the connection opening, or of the next request's first byte on a kept-alive one
  (until then it is idle, and uvicorn's ``timeout_keep_alive`` closes it, as nginx's
  ``client_header_timeout`` and ``keepalive_timeout`` share the work); the body then has as long
  again from the headers' end, plus a second for every ``MIN_BODY_RATE`` bytes it brings. Past it the connection closes, with a 408 when part of a request
  came (silently when nothing came). A client waiting for an answer, or reading a long stream, is
  never timed.
* how large a request head may grow: httptools, which uvicorn picks when installed, has no limit
  (it even gathers one header's value whole before handing it over), and h11's counts only a head
  still incomplete. Here a head is measured as it arrives, before the parser sees it: one larger
  than ``max_head_bytes`` gets a 431 and the connection closes, no more than that buffered.
* httptools frames a streamed answer to an HTTP/1.0 client in chunked coding, which HTTP/1.0 does
  not have (RFC 9112 §6.1): such an answer is sent as it is and ends with the connection, as h11
  does.

A refusal takes the shape of the API the request was for, as the app's own errors do: OpenAI's,
or on Anthropic's Messages API (``/v1/messages``, read from the request line while the head still
comes) Anthropic's, with its ``request-id`` header and its status for a body that came too slowly.

These classes lean on uvicorn's protocol internals (parser callbacks, its request/response cycle);
``tests/server/test_http_limits.py`` runs them under both parsers. Nothing here reads a request's
content: what a request says is the app's business.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from server.error_types import error_type
from server.middleware import is_messages, request_id_of

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # no httptools: uvicorn parses with h11
    HttpToolsProtocol = None  # type: ignore[assignment,misc]

DEFAULT_HEADER_TIMEOUT = 60.0  # nginx's client_header_timeout
DEFAULT_MAX_HEAD_BYTES = 64 << 10
# After a refusal, how long the client's further bytes are read (and dropped) before the connection
# closes: closing with them unread would reset it, and the client could lose the answer (nginx's
# lingering close).
LINGER_S = 2.0
# A body's time grows by a second for every this many bytes it brings (Apache mod_reqtimeout's
# MinRate): a large upload at any usable speed is never cut off, one that trickles still is.
MIN_BODY_RATE = 500
# How much of a request head is kept to read its request line (the path) from.
_REQUEST_LINE_BYTES = 8 << 10

# Where a connection stands, for the timer: reading a request's head (or new and still silent),
# reading its body, answering a request read whole, or idle after an answer (uvicorn's keep-alive
# timeout is running). The client is timed only in the first two.
_HEAD, _BODY, _BUSY, _IDLE = "head", "body", "busy", "idle"


@dataclass(frozen=True)
class HttpLimits:
    header_timeout: float = DEFAULT_HEADER_TIMEOUT  # seconds for a request's head, and again its body
    max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES  # request line and headers

    def __post_init__(self) -> None:
        if not self.header_timeout > 0 or self.max_head_bytes < 1:
            raise ValueError("the header timeout and the largest request head must be positive")


def add_header_timeout_arg(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--header-timeout``, the same for ``ferry serve`` and ``ferry router``."""
    p.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT,
        metavar="S",
        help="seconds a client may take to send a request's headers (from connecting, or from its first "
        "byte on a kept-alive connection), and as long again for its body (plus a second per 500 bytes "
        "it brings); then the connection closes, with a 408 if part of a request came (nginx's "
        "client_header_timeout; default %(default)g)",
    )


def uvicorn_options(limits: HttpLimits, parser: str = "auto") -> dict[str, Any]:
    """What ``uvicorn.Config`` takes to serve with ``limits``: the protocol class of ``parser``
    (uvicorn's names: auto, httptools, h11) and h11's own limit on a head, set to ours."""
    if parser == "httptools" or (parser == "auto" and HttpToolsProtocol is not None):
        if HttpToolsProtocol is None:
            raise ValueError("httptools is not installed")
        base: type = _LimitedHttpTools
    elif parser in ("auto", "h11"):
        base = _LimitedH11
    else:
        raise ValueError(f"unknown HTTP parser {parser!r}")
    protocol = type(base.__name__, (base,), {"limits": limits})
    return {"http": protocol, "h11_max_incomplete_event_size": limits.max_head_bytes}


def _error(
    status: int, code: str, message: str, anthropic: bool = False, request_id: str | None = None
) -> bytes:
    """A whole answer written past the app (nothing reached it): the OpenAI error shape, or on
    Anthropic's Messages API (``anthropic``) Anthropic's, as ``_anthropic_error`` words it."""
    request_id = request_id or request_id_of(None)
    ids = b"x-request-id: %s\r\n" % request_id.encode()
    if anthropic:
        status, obj = _anthropic_error(status, code, message, request_id)
        ids += b"request-id: %s\r\n" % request_id.encode()
    else:
        obj = {"error": {"message": message, "type": error_type(status), "param": None, "code": code}}
    body = json.dumps(obj).encode()
    reason = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large"}[status]
    return (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"%sconnection: close\r\n\r\n%s" % (status, reason, len(body), ids, body)
    )


def _anthropic_error(status: int, code: str, message: str, request_id: str) -> tuple[int, dict[str, Any]]:
    """The status and body Anthropic answers in these cases: a body that did not arrive in time is
    its 400 ``invalid_request_error`` with ``details.error_code`` ``request_body_timeout`` (its
    SDKs' ``BetaRequestBodyTimeoutError``); the others keep their 4xx as ``invalid_request_error``,
    the type its API uses for a 4xx it does not list (the SDKs: ``RequestTimeoutError``,
    ``RequestHeaderFieldsTooLargeError``). Not ``anthropic_protocol.error_type``: that reads a 408
    as a request that ran past ``--request-timeout`` (504 ``timeout_error``), not a slow client."""
    error: dict[str, Any] = {"type": "invalid_request_error", "message": message}
    if code == "request_body_timeout":
        status = 400
        error["details"] = {"error_code": code}
    return status, {"type": "error", "error": error, "request_id": request_id}


def _request_path(head: bytes) -> str | None:
    """The path of the request line at the start of ``head`` (None before it is whole): the route
    a request whose head never came whole was for, so its refusal takes that API's shape."""
    line, newline, _ = head.partition(b"\n")
    parts = line.split()
    if not newline or len(parts) < 2:
        return None
    target = parts[1].decode("latin-1").partition("?")[0]
    if not target.startswith("/"):  # absolute form (RFC 9112 §3.2.2): its path
        scheme, _, rest = target.partition("://")
        target = "/" + rest.partition("/")[2] if scheme and rest else target
    return target


class _Limits:
    """The limits, over either parser's protocol (the subclasses say where the parser stands)."""

    limits: HttpLimits
    # uvicorn's protocol attributes this mixin uses
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    cycle: Any
    timeout_keep_alive_task: asyncio.TimerHandle | None

    _timer: asyncio.TimerHandle | None = None
    _timed: str | None = None  # the state the running timer was started for
    _deadline = 0.0  # when it expires (loop time): a body's moves on as the body comes
    _head_bytes = 0  # bytes received while the current head was incomplete
    _head_tail = b""  # its last bytes, where its end may begin
    _head_start = b""  # its first bytes, to its request line's end: the path a refusal is shaped for
    _refused = False  # answered 408/431: what else comes is dropped

    def _state(self) -> str:
        """``_HEAD``, ``_BODY`` or ``_BUSY``, by the parser's state."""
        raise NotImplementedError

    def _where(self) -> str:
        state = self._state()
        if state == _HEAD and not self._head_bytes and self.timeout_keep_alive_task is not None:
            return _IDLE
        return state

    def _awaiting_head(self) -> bool:
        raise NotImplementedError

    def _answering(self) -> bool:
        """An answer is on its way: nothing of ours may be written into it."""
        cycle = self.cycle
        return cycle is not None and cycle.response_started and not cycle.response_complete

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._retime()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        super().connection_lost(exc)  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._timed == _BODY:
            self._deadline += len(data) / MIN_BODY_RATE
        if self._awaiting_head():
            if len(self._head_start) < _REQUEST_LINE_BYTES and b"\n" not in self._head_start:
                self._head_start += data[:_REQUEST_LINE_BYTES]
            # Measured before the parser sees it: a head past the limit never reaches the app, and
            # one that ends in this read is measured to its end, not by the read's size.
            size = self._head_size(data)
            if size > self.limits.max_head_bytes:
                limit = self.limits.max_head_bytes
                self._refuse(
                    431, "request_headers_too_large", f"Request headers are larger than {limit} bytes."
                )
                return
            self._head_bytes += len(data)
            self._head_tail = (self._head_tail + data[-3:])[-3:]
        super().data_received(data)  # type: ignore[misc]
        if self._finished():  # (uvicorn refused a malformed request: a 400)
            return
        if not self._awaiting_head():
            self._head_done()
        self._retime()

    def _head_size(self, data: bytes) -> int:
        """The size of the head arriving with ``data``: to its end if it ends there, else so far."""
        seen = self._head_tail + data  # (the end's CR LF CR LF may straddle two reads)
        ends = [i + len(sep) for sep in (b"\r\n\r\n", b"\n\n") if (i := seen.find(sep)) >= 0]
        if not ends:
            return self._head_bytes + len(data)
        return self._head_bytes - len(self._head_tail) + min(ends)

    def _head_done(self) -> None:
        # (bytes of a pipelined next head in the same read go uncounted: one read's worth at most)
        self._head_bytes = 0
        self._head_tail = b""
        self._head_start = b""

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        if not self._finished():
            self._retime()

    def _retime(self) -> None:
        """(Re)start the timer when the connection enters a state that is timed; a state that goes
        on (a head arriving byte by byte) keeps the timer it started with."""
        state = self._where()
        if state == self._timed:
            return
        self._stop_timer()
        self._timed = state
        if state in (_HEAD, _BODY):
            self._deadline = self.loop.time() + self.limits.header_timeout
            self._timer = self.loop.call_later(self.limits.header_timeout, self._expired)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        # (after a protocol switch the connection is another protocol's)
        if self._finished() or self.transport.get_protocol() is not self:
            return
        state = self._where()
        if state == _BODY and self._timed == _BODY and self._deadline > self.loop.time():
            self._timer = self.loop.call_later(self._deadline - self.loop.time(), self._expired)
            return
        self._timed = None
        seconds = f"{self.limits.header_timeout:g}"
        if state == _BODY:
            self._refuse(408, "request_body_timeout", f"The request body did not arrive within {seconds} s.")
        elif state == _HEAD and self._head_bytes:
            self._refuse(
                408, "request_header_timeout", f"The request headers did not arrive within {seconds} s."
            )
        elif state == _HEAD:
            self.transport.close()  # silent since it connected: nothing was asked, nothing is answered

    def _refused_request(self) -> tuple[bool, str | None]:
        """Whether the request refused is for Anthropic's Messages API, and its id when known: a
        body's request is the cycle's (its id as the app took it); a head's, its request line's."""
        cycle = self.cycle
        if self._where() == _BODY and cycle is not None:
            scope = cycle.scope
            request_id = scope.get("state", {}).get("request_id")
            if request_id is None:  # (the router keeps none there)
                request_id = request_id_of(dict(scope["headers"]).get(b"x-request-id"))
            return is_messages(scope), request_id
        path = _request_path(self._head_start)
        if path is None:
            return False, None
        root = getattr(self, "root_path", "")
        return is_messages({"path": root + path, "root_path": root}), None

    def _finished(self) -> bool:
        return self._refused or self.transport.is_closing()

    def _refuse(self, status: int, code: str, message: str) -> None:
        """Answer ``status`` (unless an answer is under way) and close; an app waiting for this
        request's body reads a disconnect and sends nothing more."""
        anthropic, request_id = self._refused_request()
        self._refused = True
        self._stop_timer()
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()
        if not self._answering():
            self.transport.write(_error(status, code, message, anthropic, request_id))
        if self._answering() or not self.transport.can_write_eof():  # (TLS cannot half-close)
            self.transport.close()
            return
        self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)


class _LimitedH11(_Limits, H11Protocol):
    def _state(self) -> str:
        if self.conn.their_state is h11.SEND_BODY:
            return _BODY
        if self.cycle is not None and not self.cycle.response_complete:
            return _BUSY
        return _HEAD

    def _awaiting_head(self) -> bool:
        return self.conn.their_state is h11.IDLE


if HttpToolsProtocol is not None:

    class _LimitedHttpTools(_Limits, HttpToolsProtocol):
        _in_body = False  # between a request's head and the end of its body

        def _state(self) -> str:
            if self.pipeline:  # a pipelined request waits for the answer before it
                return _BUSY
            if self._in_body:
                return _BODY
            if self.cycle is not None and not self.cycle.response_complete:
                return _BUSY
            return _HEAD

        def _awaiting_head(self) -> bool:
            return not self._in_body

        def _answering(self) -> bool:
            return bool(self.pipeline) or super()._answering()

        def on_headers_complete(self) -> None:
            self._in_body = True
            self._head_done()  # (a request without a body leaves the parser awaiting a head again)
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._in_body = False
            super().on_message_complete()

        def _start_asgi_task(self, cycle: Any, app: Callable) -> None:
            if cycle.scope["http_version"] == "1.0":
                app = _close_delimited(app, cycle)
            super()._start_asgi_task(cycle, app)


def _close_delimited(app: Callable, cycle: Any) -> Callable:
    """``app`` for an HTTP/1.0 request under httptools: an answer with no Content-Length is sent
    as it comes and ends with the connection (HTTP/1.0 closes after every answer anyway), where the
    cycle would have framed it in chunks."""

    async def close_delimited(scope: dict, receive: Callable, send: Callable) -> None:
        unframed = False

        async def send_unchunked(message: dict) -> None:
            nonlocal unframed
            if message["type"] == "http.response.start":
                names = {name.lower() for name, _ in message.get("headers", [])}
                unframed = (
                    not names & {b"content-length", b"transfer-encoding"}
                    and scope["method"] != "HEAD"
                    and message["status"] not in (204, 304)
                )
                if unframed:
                    cycle.chunked_encoding = False
            elif unframed and message["type"] == "http.response.body":
                # The cycle counts a framed body down to its Content-Length; this one has none.
                cycle.expected_content_length = len(message.get("body", b""))
            await send(message)

        await app(scope, receive, send_unchunked)

    return close_delimited
