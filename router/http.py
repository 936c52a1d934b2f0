"""Small ASGI helpers: OpenAI-format errors, JSON answers, bounded body reads, header filters.

The router is a plain ASGI app (no framework): a proxy's hot path is mostly moving bytes, and
every layer between the socket and the upstream client costs latency on every request.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from server.error_types import error_type

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# Hop-by-hop and framing headers never cross the proxy (RFC 9110 §7.6.1), nor do the headers a
# request's own ``Connection`` names (``forward_headers``). ``expect``: uvicorn answers a client's
# ``100-continue`` itself and the router sends replicas whole bodies, so a replica asked for one
# would only answer an interim 100 before its real answer.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"proxy-connection",
        b"keep-alive",
        b"expect",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
        b"accept-encoding",
    }
)
# What a replica's answer loses on the way: hop-by-hop and framing headers, those the router sets
# itself, and CORS headers: the browser talks to the router, whose policy (--allowed-origins…, its
# CORSMiddleware) must hold; relayed, a replica's ``access-control-allow-origin: *`` let in
# origins the router refuses.
RESPONSE_DROP = frozenset(
    {
        b"access-control-allow-origin",
        b"access-control-allow-credentials",
        b"access-control-allow-methods",
        b"access-control-allow-headers",
        b"access-control-expose-headers",
        b"access-control-max-age",
        b"connection",
        b"proxy-connection",
        b"keep-alive",
        b"trailer",
        b"upgrade",
        b"transfer-encoding",
        b"content-length",
        b"date",
        b"server",
        b"x-request-id",
    }
)


class BodyTooLarge(Exception):
    pass


class ClientGone(Exception):
    pass


# The ``code`` of the router's own errors by status, in the words a replica uses for the same error
# (server/errors.py): OpenAI's ``code`` is a short string or null, never the HTTP status.
ERROR_CODES = {
    400: "invalid_value",
    401: "invalid_api_key",
    403: "permission_denied",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    409: "conflict",
    413: "request_too_large",
    415: "unsupported_media_type",
    429: "rate_limit_exceeded",
    431: "request_headers_too_large",
    500: "internal_error",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "gateway_timeout",
}


def error_code(status: int) -> str | None:
    """The router's ``code`` for an error answered with ``status`` (None: no code)."""
    return ERROR_CODES.get(status)


def error_body(message: str, type_: str, code: int | str | None = None, param: str | None = None) -> bytes:
    """An OpenAI error body; ``code`` given as an HTTP status is written as that status's code
    (``error_code``), so no caller sends a number there."""
    if isinstance(code, int):
        code = error_code(code)
    return json.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}}).encode()


async def send_bytes(
    send: Send,
    status: int,
    body: bytes,
    headers: list[tuple[bytes, bytes]] | None = None,
    content_type: bytes = b"application/json",
) -> None:
    hdrs = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    if headers:
        hdrs.extend(h for h in headers if h[0].lower() != b"content-type")
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": body})


async def send_json(
    send: Send, status: int, obj: Any, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    await send_bytes(send, status, json.dumps(obj).encode(), headers)


async def send_error(
    send: Send,
    status: int,
    message: str,
    headers: list[tuple[bytes, bytes]] | None = None,
    code: str | None = None,
) -> None:
    """An OpenAI error answer; ``code`` by default the status's (``error_code``)."""
    body = error_body(message, error_type(status), code if code is not None else error_code(status))
    await send_bytes(send, status, body, headers)


async def read_body(receive: Receive, limit: int) -> bytes:
    """The whole request body, or BodyTooLarge past ``limit`` bytes, or ClientGone."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge()
            chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks) if len(chunks) != 1 else chunks[0]


def header(scope: Scope, name: bytes) -> bytes | None:
    for k, v in scope["headers"]:
        if k == name:
            return v
    return None


def forward_headers(scope: Scope) -> list[tuple[bytes, bytes]]:
    """The client's headers a replica gets: none of HOP_BY_HOP, none its ``Connection`` lists."""
    headers = scope["headers"]
    drop = HOP_BY_HOP
    listed = [v for k, v in headers if k == b"connection"]
    if listed:
        drop = drop | {name.strip().lower() for v in listed for name in v.split(b",")}
    return [(k, v) for k, v in headers if k not in drop and k != b"x-request-id"]


def bearer_ok(scope: Scope, key: str) -> bool:
    """``Authorization: Bearer KEY``, or Anthropic's ``x-api-key: KEY`` (its SDKs' Messages API)."""
    value = header(scope, b"authorization")
    if value is not None and hmac.compare_digest(value, f"Bearer {key}".encode("latin-1")):
        return True
    other = header(scope, b"x-api-key")
    return other is not None and hmac.compare_digest(other, key.encode("latin-1"))
