"""server/http_limits.py under both of uvicorn's parsers (httptools and h11), then wired into a real
``ferry serve``: slow clients (a head or a body that trickles, a connection that says nothing) are
cut off after ``--header-timeout`` with a 408, a request head past the limit gets a 431 before it is
buffered whole, and an HTTP/1.0 client's streamed answer is not framed in chunks (HTTP/1.0 has none).
What must not change: kept-alive idle connections (uvicorn's keep-alive timeout, not ours), answers
streamed for longer than the timeout. Raw loopback sockets throughout; timings are bounds, not
measurements."""

from __future__ import annotations

import asyncio
import contextlib
import json
import select
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import httpx2
import pytest
import uvicorn
from anthropic.types.beta_request_body_timeout_error import BetaRequestBodyTimeoutError

from server.http_limits import HttpLimits, uvicorn_options
from tests.server.conftest import self_signed_certificate

PARSERS = ["httptools", "h11"]
BOUND_S = 30.0  # what "soon" means here: far above the 1 s timeouts, far below "never"
DISCONNECTS: list[str] = []  # paths whose request body the test app read as a disconnect


async def _app(scope: dict, receive, send) -> None:  # noqa: ANN001 - ASGI callables
    """/stream: four lines 0.5 s apart, unframed; anything else: reads the body, answers its length."""
    if scope["type"] != "http":
        return
    if scope["path"] == "/stream":
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]}
        )
        for i in range(4):
            await send({"type": "http.response.body", "body": b"part%d\n" % i, "more_body": True})
            await asyncio.sleep(0.5)
        await send({"type": "http.response.body", "body": b""})
        return
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            DISCONNECTS.append(scope["path"])
            return
        size += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    body = b"got %d" % size
    headers = [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@contextlib.contextmanager
def _serving(parser: str, limits: HttpLimits, **options: object) -> Iterator[int]:
    """The test app under uvicorn with ``limits`` (keep-alive 30 s, as ``ferry serve``'s; ``options``:
    more of uvicorn's), in a thread."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(
        _app,
        log_level="warning",
        lifespan="off",
        timeout_keep_alive=30,
        **uvicorn_options(limits, parser),
        **options,  # type: ignore[arg-type]
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + BOUND_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(BOUND_S)


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=BOUND_S)
    return sock


def _trickle_until_answered(sock: socket.socket, start: bytes, more: bytes) -> float:
    """Send ``start``, then ``more`` a byte every 0.2 s until the server answers or closes; the
    seconds that took (at most BOUND_S: the server never answering fails the test)."""
    begin = time.monotonic()
    sock.sendall(start)
    for byte in more:
        if select.select([sock], [], [], 0.2)[0]:
            return time.monotonic() - begin
        assert time.monotonic() - begin < BOUND_S, "the slow client was never cut off"
        sock.sendall(bytes([byte]))
    raise AssertionError("the server waited for the whole slow request")


def _read_to_close(sock: socket.socket) -> bytes:
    wire = b""
    while data := sock.recv(65536):
        wire += data
    return wire


def _parse(wire: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
    head, _, body = wire.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    headers = {k.lower(): v for k, v in (line.split(b": ", 1) for line in lines[1:])}
    return int(lines[0].split(b" ")[1]), headers, body


def _error(wire: bytes) -> tuple[int, dict]:
    status, headers, body = _parse(wire)
    assert headers[b"connection"] == b"close" and int(headers[b"content-length"]) == len(body)
    return status, json.loads(body)["error"]


def _request(sock: socket.socket, path: bytes = b"/echo", version: bytes = b"1.1") -> tuple[int, bytes]:
    """One request on a kept-alive connection; its answer by Content-Length."""
    sock.sendall(b"GET %s HTTP/%s\r\nhost: x\r\n\r\n" % (path, version))
    wire = b""
    while b"\r\n\r\n" not in wire:
        data = sock.recv(65536)
        assert data, f"closed after {wire!r}"
        wire += data
    status, headers, body = _parse(wire)
    while len(body) < int(headers[b"content-length"]):
        body += sock.recv(65536)
    return status, body


@pytest.mark.parametrize("parser", PARSERS)
def test_a_head_that_trickles_gets_408(parser: str) -> None:
    with _serving(parser, HttpLimits(header_timeout=1.0)) as port, _connect(port) as sock:
        took = _trickle_until_answered(sock, b"GET /echo HTTP/1.1\r\nhost: x\r\n", b"x-slow: " + b"y" * 1000)
        status, error = _error(_read_to_close(sock))
    assert status == 408 and took < BOUND_S
    assert error == {
        "message": "The request headers did not arrive within 1 s.",
        "type": "TimeoutError",
        "param": None,
        "code": "request_header_timeout",
    }


@pytest.mark.parametrize("parser", PARSERS)
def test_a_body_that_trickles_gets_408_and_the_app_reads_a_disconnect(parser: str) -> None:
    head = b"POST /trickled-%s HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\n" % parser.encode()
    with _serving(parser, HttpLimits(header_timeout=1.0)) as port, _connect(port) as sock:
        _trickle_until_answered(sock, head + b"0123456789", b"z" * 990)
        status, error = _error(_read_to_close(sock))
        deadline = time.monotonic() + BOUND_S
        while f"/trickled-{parser}" not in DISCONNECTS and time.monotonic() < deadline:
            time.sleep(0.05)
    assert status == 408 and error["code"] == "request_body_timeout"
    assert error["message"] == "The request body did not arrive within 1 s."
    assert f"/trickled-{parser}" in DISCONNECTS  # the app's wait for the body ended


@pytest.mark.parametrize("parser", PARSERS)
def test_a_body_that_keeps_coming_is_read_past_the_timeout(parser: str) -> None:
    """A body's time grows with what it brings (a second per MIN_BODY_RATE bytes): a large upload
    on a slow link is read whole, however long it takes."""
    head = b"POST /echo HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: 20000\r\n\r\n"
    with _serving(parser, HttpLimits(header_timeout=1.0)) as port, _connect(port) as sock:
        sock.sendall(head)
        begin = time.monotonic()
        for _ in range(20):  # 1,000 bytes every 0.1 s: twice the timeout in all
            sock.sendall(b"b" * 1000)
            time.sleep(0.1)
        assert time.monotonic() - begin > 1.0
        assert _parse(_read_to_close(sock))[::2] == (200, b"got 20000")


@pytest.mark.parametrize("parser", PARSERS)
def test_a_silent_connection_is_closed_without_an_answer(parser: str) -> None:
    with _serving(parser, HttpLimits(header_timeout=1.0)) as port, _connect(port) as sock:
        assert sock.recv(100) == b""  # uvicorn alone waits for ever (no keep-alive timer before a request)


@pytest.mark.parametrize("parser", PARSERS)
def test_an_oversized_head_gets_431(parser: str) -> None:
    with _serving(parser, HttpLimits(max_head_bytes=4096)) as port:
        with _connect(port) as sock:  # under the limit: served
            sock.sendall(
                b"GET /echo HTTP/1.1\r\nhost: x\r\nconnection: close\r\nx-big: %s\r\n\r\n" % (b"y" * 3500)
            )
            assert _parse(_read_to_close(sock))[:1] == (200,)
        with _connect(port) as sock:  # past it, whole in one read (the parsers' limits miss it)
            sock.sendall(b"GET /echo HTTP/1.1\r\nhost: x\r\nx-big: %s\r\n\r\n" % (b"y" * 6000))
            assert _error(_read_to_close(sock))[0] == 431
        with _connect(port) as sock:  # past it, still arriving: refused at once
            sock.sendall(b"GET /echo HTTP/1.1\r\nhost: x\r\nx-big: " + b"y" * 6000)
            status, error = _error(_read_to_close(sock))
        assert status == 431 and error == {
            "message": "Request headers are larger than 4096 bytes.",
            "type": "RequestHeaderFieldsTooLargeError",
            "param": None,
            "code": "request_headers_too_large",
        }
        with _connect(port) as sock:  # megabytes of one header: answered at the limit, then cut off
            answer, sent, took = _send_huge_header(sock, b"/echo")
            assert answer.startswith(b"HTTP/1.1 431 "), answer  # while the header was still coming
            assert sent < 64 << 20 and took < BOUND_S  # and then closed


def _anthropic_error(wire: bytes) -> tuple[int, dict, anthropic.APIStatusError]:
    """An answer on the Messages API: its status, its body (Anthropic's shape, named by its
    ``request-id`` header) and the exception the anthropic SDK makes of it."""
    status, headers, body = _parse(wire)
    assert headers[b"connection"] == b"close" and int(headers[b"content-length"]) == len(body)
    obj = json.loads(body)
    assert obj["type"] == "error" and obj["request_id"] == headers[b"request-id"].decode()
    assert headers[b"x-request-id"] == headers[b"request-id"]
    request = httpx2.Request("POST", "http://127.0.0.1/v1/messages")
    response = httpx2.Response(status, headers=dict(headers), content=body, request=request)
    client = anthropic.Anthropic(api_key="k", max_retries=0)
    return status, obj["error"], client._make_status_error_from_response(response)


@pytest.mark.parametrize("parser", PARSERS)
def test_refusals_on_the_messages_api_are_anthropics(parser: str) -> None:
    """A slow or oversized request to ``/v1/messages`` is refused in Anthropic's shape, which its
    SDK reads into its typed errors: a body that trickles is Anthropic's 400 ``request_body_timeout``
    (``BetaRequestBodyTimeoutError``), a head that trickles a 408 and one too large a 431, both
    ``invalid_request_error``. The path is read from the request line while the head still comes."""
    limits = HttpLimits(header_timeout=1.0, max_head_bytes=4096)
    head = b"POST /v1/messages HTTP/1.1\r\nhost: x\r\nx-request-id: slow-1\r\ncontent-length: 1000\r\n\r\n"
    with _serving(parser, limits) as port:
        with _connect(port) as sock:
            _trickle_until_answered(sock, head + b"{", b"z" * 999)
            status, error, raised = _anthropic_error(_read_to_close(sock))
        assert status == 400 and type(raised) is BetaRequestBodyTimeoutError
        assert error == {
            "type": "invalid_request_error",
            "message": "The request body did not arrive within 1 s.",
            "details": {"error_code": "request_body_timeout"},
        }
        assert raised.request_id == "slow-1"  # the client's id, as the app takes it
        with _connect(port) as sock:
            start = b"POST /v1/messages/count_tokens?beta=true HTTP/1.1\r\nhost: x\r\n"
            _trickle_until_answered(sock, start, b"x-slow: " + b"y" * 1000)
            status, error, raised = _anthropic_error(_read_to_close(sock))
        assert status == 408 and type(raised) is anthropic.RequestTimeoutError
        assert error == {
            "type": "invalid_request_error",
            "message": "The request headers did not arrive within 1 s.",
        }
        with _connect(port) as sock:
            sock.sendall(b"POST /v1/messages HTTP/1.1\r\nhost: x\r\nx-big: " + b"y" * 6000)
            status, error, raised = _anthropic_error(_read_to_close(sock))
        assert status == 431 and type(raised) is anthropic.RequestHeaderFieldsTooLargeError
        assert error == {
            "type": "invalid_request_error",
            "message": "Request headers are larger than 4096 bytes.",
        }
        with _connect(port) as sock:  # another route, or a path that only starts alike: OpenAI's
            sock.sendall(b"POST /v1/messagesx HTTP/1.1\r\nhost: x\r\nx-big: " + b"y" * 6000)
            status, error = _error(_read_to_close(sock))
        assert (status, error["code"]) == (431, "request_headers_too_large")


def _send_huge_header(sock: socket.socket, path: bytes) -> tuple[bytes, int, float]:
    """Send a GET whose one header grows by 64 KiB every 10 ms (up to 64 MiB or BOUND_S): the
    first answer seen, the bytes sent, and the seconds until the server closed (or the bound)."""
    sock.sendall(b"GET %s HTTP/1.1\r\nhost: x\r\nx-big: " % path)
    answer, sent, begin = b"", 0, time.monotonic()
    with contextlib.suppress(OSError):  # reset: the server closed with our bytes unread
        while sent < 64 << 20 and time.monotonic() - begin < BOUND_S:
            if not answer and select.select([sock], [], [], 0)[0]:
                answer = sock.recv(65536)
            sock.sendall(b"y" * (64 << 10))
            sent += 64 << 10
            time.sleep(0.01)
    return answer, sent, time.monotonic() - begin


def _head_of(size: int) -> bytes:
    """A POST head of exactly ``size`` bytes (its request line and headers, to the empty line)."""
    start = b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\nconnection: close\r\nx-pad: "
    return start + b"p" * (size - len(start) - 4) + b"\r\n\r\n"


@pytest.mark.parametrize("parser", PARSERS)
def test_the_head_limit_is_exact_wherever_the_reads_split_it(parser: str) -> None:
    """A head of the limit's size is served (its body counts for nothing), one byte more is not,
    whichever read its end arrives in (the empty line split between two reads included)."""
    head = _head_of(4096)
    with _serving(parser, HttpLimits(max_head_bytes=4096)) as port:
        for cut in (100, 4093, 4094, 4095):
            with _connect(port) as sock:
                sock.sendall(head[:cut])
                time.sleep(0.05)
                sock.sendall(head[cut:] + b"ok")
                status, _, body = _parse(_read_to_close(sock))
            assert (status, body) == (200, b"got 2"), cut
        with _connect(port) as sock:
            sock.sendall(_head_of(4097) + b"ok")
            assert _error(_read_to_close(sock))[0] == 431


@pytest.mark.parametrize("parser", PARSERS)
def test_kept_alive_idle_and_long_streams_are_not_timed(parser: str) -> None:
    """Idle between requests is uvicorn's keep-alive timeout's (30 s here), not the header
    timeout's; an answer streamed for twice the timeout is whole."""
    with _serving(parser, HttpLimits(header_timeout=1.0)) as port, _connect(port) as sock:
        assert _request(sock) == (200, b"got 0")
        time.sleep(2.5)
        assert _request(sock) == (200, b"got 0")
        sock.sendall(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")
        wire = b""
        while not wire.endswith(b"\r\n0\r\n\r\n"):
            data = sock.recv(65536)
            assert data, f"closed after {wire!r}"
            wire += data
        assert wire.count(b"part") == 4
        assert _request(sock) == (200, b"got 0")  # and the connection still serves


@pytest.mark.parametrize("parser", PARSERS)
def test_an_http10_stream_is_not_chunked(parser: str) -> None:
    """HTTP/1.0 has no chunked coding (RFC 9112 §6.1): an answer without a length runs to the
    connection's close. httptools used to chunk it, and the client read the chunk sizes as body."""
    with _serving(parser, HttpLimits()) as port, _connect(port) as sock:
        sock.sendall(b"GET /stream HTTP/1.0\r\n\r\n")
        status, headers, body = _parse(_read_to_close(sock))
    assert status == 200 and b"transfer-encoding" not in headers and b"content-length" not in headers
    assert body == b"part0\npart1\npart2\npart3\n"


@pytest.mark.parametrize("parser", PARSERS)
def test_refusals_over_tls_are_answered_too(parser: str, tmp_path: Path) -> None:
    """A TLS connection cannot be half-closed to linger: the answer is written, then it closes."""
    key, cert = self_signed_certificate(tmp_path)
    context = ssl.create_default_context(cafile=str(cert))
    limits = HttpLimits(header_timeout=1.0, max_head_bytes=4096)
    with _serving(parser, limits, ssl_keyfile=str(key), ssl_certfile=str(cert)) as port:
        with context.wrap_socket(_connect(port), server_hostname="127.0.0.1") as sock:
            _trickle_until_answered(sock, b"GET /echo HTTP/1.1\r\nhost: x\r\n", b"x-slow: " + b"y" * 1000)
            assert _error(_read_to_close(sock))[1]["code"] == "request_header_timeout"
        with context.wrap_socket(_connect(port), server_hostname="127.0.0.1") as sock:
            sock.sendall(b"GET /echo HTTP/1.1\r\nhost: x\r\nx-big: " + b"y" * 6000)
            assert _error(_read_to_close(sock))[0] == 431


@pytest.fixture(scope="module")
def limited_server(tiny_llama: Path, serve_logs: Path, server_process) -> Iterator:
    srv = server_process(
        tiny_llama, ["--header-timeout", "1", "--h11-max-incomplete-event-size", "4096"], serve_logs
    ).start()
    yield srv
    srv.stop()


def test_ferry_serve_cuts_off_slow_and_oversized_requests(limited_server) -> None:
    port = limited_server.port
    with _connect(port) as sock:
        _trickle_until_answered(sock, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n", b"x" * 1000)
        assert _error(_read_to_close(sock))[1]["code"] == "request_header_timeout"
    with _connect(port) as sock:  # the Messages API's, behind the app's middleware
        head = b"POST /v1/messages HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n"
        _trickle_until_answered(sock, head, b"{" * 100)
        status, error, raised = _anthropic_error(_read_to_close(sock))
        assert (status, error["details"], type(raised)) == (
            400,
            {"error_code": "request_body_timeout"},
            BetaRequestBodyTimeoutError,
        )
    with _connect(port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"y" * 6000)
        assert _error(_read_to_close(sock))[0] == 431
    with _connect(port) as sock:  # idle longer than the timeout on a kept-alive connection: still served
        assert _request(sock, b"/health")[0] == 200
        time.sleep(2.5)
        assert _request(sock, b"/health")[0] == 200


def test_ferry_serve_streams_to_an_http10_client_unchunked(limited_server) -> None:
    request = {"model": limited_server.model_name, "prompt": "hi", "max_tokens": 3, "temperature": 0}
    whole = httpx.post(limited_server.url + "/v1/completions", json=request, timeout=BOUND_S).json()
    body = json.dumps({**request, "stream": True}).encode()
    with _connect(limited_server.port) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.0\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (len(body), body)
        )
        status, headers, stream = _parse(_read_to_close(sock))
    assert status == 200 and headers[b"content-type"].startswith(b"text/event-stream")
    assert b"transfer-encoding" not in headers and headers[b"connection"] == b"close"
    events = stream.decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(e.removeprefix("data: "))["choices"][0] for e in events[:-2]]
    assert "".join(c["text"] for c in chunks) == whole["choices"][0]["text"]
    assert chunks[-1]["finish_reason"] == "length"
