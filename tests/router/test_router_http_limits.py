"""The router's front door against slow and oversized clients (server/http_limits.py, as on a
replica: tests/server/test_http_limits.py), over raw loopback sockets in front of a real replica:
``--header-timeout`` cuts off a request that trickles in (408) and a connection that says nothing,
``--max-header-bytes`` refuses a head while it is still arriving (431: it used to be buffered whole
and only then checked), and an HTTP/1.0 client's relayed stream is not framed in chunks. A stream
that runs longer than the timeout, and a kept-alive connection idle longer, are untouched."""

from __future__ import annotations

import json
import select
import signal
import socket
import time

import pytest
from anthropic import RequestHeaderFieldsTooLargeError
from anthropic.types.beta_request_body_timeout_error import BetaRequestBodyTimeoutError
from router_harness import Cluster, Proc

from tests.server.test_http_limits import (
    _anthropic_error,
    _connect,
    _parse,
    _read_to_close,
    _send_huge_header,
    _trickle_until_answered,
)

MODEL = "llama"
BOUND_S = 30.0  # "soon": far above the 1 s timeout, far below "never"


@pytest.fixture(scope="module")
def replica(cluster: Cluster) -> Proc:
    (replica,) = cluster.replicas(1)
    return replica


@pytest.fixture(scope="module")
def router(cluster: Cluster, replica: Proc) -> Proc:
    # Health probes far apart and patient: a replica frozen for a moment stays in rotation.
    return cluster.router(
        "--replica", replica.url, "--header-timeout", "1", "--max-header-bytes", "4096",
        "--health-interval", "5", "--health-timeout", "10",
    )  # fmt: skip


def _health(sock: socket.socket) -> int:
    sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
    wire = b""
    while b"\r\n\r\n" not in wire:
        data = sock.recv(65536)
        assert data, f"closed after {wire!r}"
        wire += data
    status, headers, body = _parse(wire)
    while len(body) < int(headers[b"content-length"]):
        body += sock.recv(65536)
    return status


def _post(path: bytes, body: dict, version: bytes = b"1.1") -> bytes:
    raw = json.dumps(body).encode()
    return b"POST %s HTTP/%s\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        path,
        version,
        len(raw),
        raw,
    )


def test_a_request_that_trickles_in_gets_408(router: Proc) -> None:
    with _connect(router.port) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
        begin = time.monotonic()
        for byte in b"x-slow: " + b"y" * 1000:
            if select.select([sock], [], [], 0.2)[0]:
                break
            assert time.monotonic() - begin < BOUND_S, "the slow client was never cut off"
            sock.sendall(bytes([byte]))
        status, headers, body = _parse(_read_to_close(sock))
    assert status == 408 and headers[b"connection"] == b"close"
    assert json.loads(body) == {
        "error": {
            "message": "The request headers did not arrive within 1 s.",
            "type": "TimeoutError",
            "param": None,
            "code": "request_header_timeout",
        }
    }
    with _connect(router.port) as sock:  # nothing at all: closed, nothing answered
        assert sock.recv(100) == b""


def test_the_messages_api_gets_anthropics_refusals(router: Proc) -> None:
    """A body that trickles to the router's ``/v1/messages`` is refused as Anthropic refuses one
    (400 ``request_body_timeout``: the SDK's ``BetaRequestBodyTimeoutError``), its id in the
    ``request-id`` header the SDK reads; a head too large there, a 431 in Anthropic's shape."""
    head = b"POST /v1/messages HTTP/1.1\r\nhost: x\r\nx-request-id: r-slow\r\ncontent-length: 500\r\n\r\n{"
    with _connect(router.port) as sock:
        _trickle_until_answered(sock, head, b" " * 499)
        status, error, raised = _anthropic_error(_read_to_close(sock))
    assert (status, type(raised), raised.request_id) == (400, BetaRequestBodyTimeoutError, "r-slow")
    assert error["details"] == {"error_code": "request_body_timeout"}
    with _connect(router.port) as sock:
        answer, _, _ = _send_huge_header(sock, b"/v1/messages")
    status, error, raised = _anthropic_error(answer)
    assert (status, type(raised)) == (431, RequestHeaderFieldsTooLargeError)
    assert error == {
        "type": "invalid_request_error",
        "message": "Request headers are larger than 4096 bytes.",
    }


def test_an_oversized_head_gets_431_while_it_is_still_coming(router: Proc) -> None:
    with _connect(router.port) as sock:
        answer, sent, took = _send_huge_header(sock, b"/health")
    assert answer.startswith(b"HTTP/1.1 431 "), answer
    assert json.loads(_parse(answer)[2])["error"]["code"] == "request_headers_too_large"
    assert sent < 64 << 20 and took < BOUND_S  # and then it closed
    with _connect(router.port) as sock:  # a head under the limit is served
        sock.sendall(
            b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\nx-big: %s\r\n\r\n" % (b"y" * 3500)
        )
        assert _parse(_read_to_close(sock))[0] == 200


def test_an_http10_client_gets_a_relayed_stream_unchunked(router: Proc) -> None:
    request = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "temperature": 0, "stream": True}
    with _connect(router.port) as sock:
        sock.sendall(_post(b"/v1/completions", request, b"1.0"))
        status, headers, stream = _parse(_read_to_close(sock))
    assert status == 200 and b"transfer-encoding" not in headers and headers[b"connection"] == b"close"
    events = stream.decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert json.loads(events[-3].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"


def test_long_streams_and_idle_kept_alive_connections_are_not_cut(router: Proc, replica: Proc) -> None:
    # 1000 tokens: still streaming when the replica is stopped, even after a loaded machine's stall.
    request = {"model": MODEL, "prompt": "hi", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with _connect(router.port) as sock:
        assert _health(sock) == 200
        time.sleep(2.5)  # idle on a kept-alive connection: uvicorn's keep-alive timeout's (60 s)
        assert _health(sock) == 200
        sock.sendall(_post(b"/v1/completions", request))
        wire = sock.recv(65536)
        assert replica.proc is not None
        replica.proc.send_signal(signal.SIGSTOP)  # the stream stalls for longer than the timeout
        try:
            assert b"[DONE]" not in wire  # (1000 tokens take far longer than one read)
            time.sleep(2.5)
        finally:
            replica.proc.send_signal(signal.SIGCONT)
        while not wire.endswith(b"\r\n0\r\n\r\n"):
            data = sock.recv(65536)
            assert data, f"closed after {wire!r}"
            wire += data
        assert b"data: [DONE]" in wire and wire.count(b'"finish_reason":"length"') == 1
        assert _health(sock) == 200  # and the connection still serves
