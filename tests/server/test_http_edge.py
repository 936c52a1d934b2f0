"""A replica's HTTP edge as odd clients meet it, over raw loopback sockets: compressed request
bodies (``Content-Encoding``), which the server does not decode, get a clear 415 in the route's
error shape instead of a "not JSON" 400 (or, for a plain body under a false label, an answer)."""

from __future__ import annotations

import gzip
import json
import socket

import anthropic
import pytest
from anthropic.types.shared.request_body_encoding_unsupported_error import RequestBodyEncodingUnsupportedError


def _exchange(port: int, request: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
    """Send one request (``Connection: close``) and read the whole answer: status, headers (lower-case
    names), body."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(request)
        wire = b""
        while data := sock.recv(65536):
            wire += data
    head, _, body = wire.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    headers = dict(line.lower().split(b": ", 1) for line in lines[1:])
    return int(lines[0].split(b" ")[1]), headers, body


def _post(port: int, path: str, body: bytes, encoding: bytes) -> bytes:
    return (
        b"POST %s HTTP/1.1\r\nhost: 127.0.0.1:%d\r\nconnection: close\r\ncontent-type: application/json\r\n"
        b"content-encoding: %s\r\ncontent-length: %d\r\n\r\n%s"
        % (path.encode(), port, encoding, len(body), body)
    )


@pytest.mark.parametrize(
    ("path", "payload"),
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),  # served around FastAPI
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
        ("/tokenize", {"prompt": "hi"}),  # a FastAPI route
    ],
)
def test_a_compressed_body_gets_415(server, path: str, payload: dict) -> None:
    raw = json.dumps({"model": server.model_name, **payload}).encode()
    status, headers, body = _exchange(server.port, _post(server.port, path, gzip.compress(raw), b"gzip"))
    assert status == 415
    assert headers[b"accept-encoding"] == b"identity"  # what the server takes (RFC 9110 §12.5.3)
    assert json.loads(body) == {
        "error": {
            "message": "Content-Encoding 'gzip' is not supported: send the request body uncompressed.",
            "type": "UnsupportedMediaTypeError",
            "param": None,
            "code": "unsupported_content_encoding",
        }
    }
    # A plain body labelled compressed is refused too (it would pass on a false label); identity
    # (or an empty value) is no coding at all.
    status, _, body = _exchange(server.port, _post(server.port, path, raw, b"br"))
    assert status == 415 and "'br'" in json.loads(body)["error"]["message"]
    for label in (b"identity", b"Identity", b""):
        status, _, body = _exchange(server.port, _post(server.port, path, raw, label))
        assert status == 200, body


def test_a_compressed_messages_body_gets_anthropics_400(server) -> None:
    """On the Messages API, as Anthropic answers it: a 400 ``invalid_request_error`` whose
    ``details.error_code`` is ``request_body_encoding_unsupported``, which its SDK raises as
    ``RequestBodyEncodingUnsupportedError``."""
    raw = json.dumps(
        {"model": server.model_name, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    ).encode()
    port = server.port
    status, headers, body = _exchange(
        port, _post(port, "/v1/messages", gzip.compress(raw), b"gzip, identity")
    )
    assert status == 400 and headers[b"accept-encoding"] == b"identity"
    error = json.loads(body)
    assert error.pop("request_id") == headers[b"request-id"].decode() and error == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "Content-Encoding 'gzip' is not supported: send the request body uncompressed.",
            "details": {"error_code": "request_body_encoding_unsupported"},
        },
    }
    client = anthropic.Anthropic(base_url=server.url, api_key="k", max_retries=0)
    with pytest.raises(RequestBodyEncodingUnsupportedError) as refused:  # a plain body labelled br
        client.messages.create(
            model=server.model_name,
            max_tokens=2,
            messages=[{"role": "user", "content": "hi"}],
            extra_headers={"content-encoding": "br", "x-request-id": "enc-1"},
        )
    assert (refused.value.status_code, refused.value.type, refused.value.request_id) == (
        400,
        "invalid_request_error",
        "enc-1",
    )


def test_a_head_health_probe_is_answered_without_a_body(server) -> None:
    """A load balancer probing with HEAD gets /health's status (a 405 before), and no body."""
    request = b"HEAD /health HTTP/1.1\r\nhost: 127.0.0.1:%d\r\nconnection: close\r\n\r\n" % server.port
    status, headers, body = _exchange(server.port, request)
    assert (status, body) == (200, b"")
    assert headers[b"content-type"] == b"application/json"
