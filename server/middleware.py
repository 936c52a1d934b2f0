"""Pure-ASGI edge checks that run before any route: request id, body size, API key.

Kept as raw ASGI (not Starlette's BaseHTTPMiddleware) so streaming responses pass through
untouched and the original ``receive`` still delivers ``http.disconnect`` to the handlers,
which is how a gone client's request gets aborted in the engine.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from server.anthropic_protocol import anthropic_status, error_body
from server.errors import APIError
from server.tracing import set_request_trace, trace_headers

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

REQUEST_ID_HEADER = b"x-request-id"
# Anthropic names every answer's request in this header (its SDKs' ``_request_id``): sent as well
# on the Messages API, with the same id.
ANTHROPIC_REQUEST_ID_HEADER = b"request-id"
# Ids travel into engine request ids, logs and headers: keep them short and printable.
_VALID_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:/=+\-]{1,128}$")
# Paths that need the API key (vLLM protects /v1 only; /tokenize, /detokenize and the scoring
# routes expose the model too; /reset_prefix_cache, sleep mode, pauses, the profiler and weight
# updates change replica state). /health, /metrics and /version stay open for load balancers and Prometheus.
_PROTECTED_PREFIXES = (
    "/v1/",
    "/v2/",
    "/tokenize",
    "/detokenize",
    "/score",
    "/rerank",
    "/classify",
    "/pooling",
    "/invocations",
    "/inference/",  # vLLM's tokens-in/tokens-out generate (server/token_routes.py)
    "/reset_prefix_cache",
    "/sleep",
    "/wake_up",
    "/is_sleeping",
    "/update_weights_from_disk",
    "/pause",
    "/resume",
    "/is_paused",
    "/get_world_size",
    "/reset_mm_cache",
    "/reset_encoder_cache",
    "/start_profile",
    "/stop_profile",
)
# Routes that submit to the engine: announced to it as soon as their body is in (see ``announce``).
_GENERATION_PATHS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/invocations",
    "/inference/v1/generate",  # vLLM's tokens-in/tokens-out generate (server/token_routes.py)
)


# Uploads (OpenAI's Files API): multipart bodies, limited by max_file_bytes instead.
_UPLOAD_PATH = "/v1/files"


# Routes whose requests run on the engine: what ``GET /load`` counts (vLLM's server load).
_LOAD_PATHS = frozenset(
    (
        *_GENERATION_PATHS,
        "/v1/embeddings",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
        "/classify",
        "/v1/classify",
        "/pooling",
    )
)


def request_id_of(raw: bytes | None) -> str:
    """A request's id: its ``X-Request-Id`` when that is one the id can travel as, else a new one.
    The router takes ids the same way, so every replica it sends a request to names it alike."""
    request_id = raw.decode("latin-1") if raw is not None else ""
    # 128 random bits, as long as uuid4().hex: 0.37 us against its 1.8 (no UUID object)
    return request_id if _VALID_REQUEST_ID.match(request_id) else os.urandom(16).hex()


# vLLM's ``request_id`` field of a ``POST /v1/responses`` body: the response's id as given, so one
# that a ``/v1/responses/{id}`` path can name (``X-Request-Id``'s characters but ``/``).
RESPONSE_ID_PATTERN = r"^[A-Za-z0-9._:=+\-]{1,128}$"


def response_id_for(request_id: str, named: str | None = None) -> str:
    """The id of the Responses API response served under ``request_id`` (the router's affinity
    derives it alike): ``named`` when the body names it (vLLM's ``request_id`` field, valid by
    ``RESPONSE_ID_PATTERN``: a replica refuses any other), else ``resp_`` and the request id, or,
    for a request id with ``/`` (fine in ``X-Request-Id``, not in the ``/v1/responses/{id}`` path),
    a digest of it."""
    if named is not None:
        return named
    if "/" in request_id:
        return "resp_" + hashlib.blake2b(request_id.encode(), digest_size=16).hexdigest()
    return f"resp_{request_id}"


@dataclass
class ServerLoad:
    """Requests on the engine's routes, from their arrival to their last byte (``GET /load``)."""

    requests: int = 0

    def total(self) -> int:
        """The replica's: this process serves all of them."""
        return self.requests


class ReplicaLoad:
    """``ServerLoad`` in one of several API server processes (``--api-server-count``): each change
    of this process's count is told to the engine process (``EngineClient.report_load``), which
    passes every API server the others' sum with its stats (``EngineClient.load_elsewhere``), so
    ``GET /load`` answers for the replica from whichever API server it reaches, as ``/metrics``
    does. The others' part is as fresh as their last report (within ~0.15 s): a load balancer's
    number, not admission's."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._requests = 0

    @property
    def requests(self) -> int:
        return self._requests

    @requests.setter
    def requests(self, value: int) -> None:
        if value != self._requests:
            self._requests = value
            self._engine.report_load(value)

    def total(self) -> int:
        return self._requests + self._engine.load_elsewhere


def route_path(scope: Scope) -> str:
    """The path routes match: without the app's root path (``--root-path``) when the request carries
    it, as Starlette routes, so a prefixed path is checked for the API key like a bare one."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root) : len(root) + 1] in ("", "/"):
        return path[len(root) :] or "/"
    return path


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return None


async def _send_error(send: Send, error: APIError, request_id: str, anthropic: bool = False) -> None:
    """The error answered before the app runs: OpenAI's shape, or Anthropic's on its Messages API."""
    if anthropic:
        body = json.dumps(error_body(error, request_id)).encode()
    else:
        body = error.body().model_dump_json().encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"x-request-id", request_id.encode()),
    ]
    if anthropic:
        headers.append((ANTHROPIC_REQUEST_ID_HEADER, request_id.encode()))
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    status = anthropic_status(error.status, error.code) if anthropic else error.status
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def is_messages(scope: Scope) -> bool:
    """Whether a request is for Anthropic's Messages API (``/v1/messages`` and every path under
    it, known or not): its errors take Anthropic's shape."""
    path = route_path(scope)
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def unsupported_encoding(scope: Scope) -> str | None:
    """A request body's ``Content-Encoding`` other than ``identity``, or None. Bodies are read as
    they come (as vLLM does): a compressed one would fail as "not JSON", which hides the cause,
    and one labelled compressed but sent plain would pass on a false label. The router shares it."""
    encodings = [v for k, v in scope.get("headers", ()) if k == b"content-encoding"]
    if not encodings:  # the usual case, in one pass over the headers
        return None
    codings = [c.strip().lower() for v in encodings for c in v.split(b",")]
    unsupported = [c for c in codings if c not in (b"", b"identity")]
    return b", ".join(unsupported).decode("latin-1") if unsupported else None


def unsupported_encoding_error(coding: str) -> APIError:
    """415 with ``Accept-Encoding: identity``, the codings a server takes (RFC 9110 §12.5.3)."""
    return APIError(
        415,
        f"Content-Encoding {coding!r} is not supported: send the request body uncompressed.",
        code="unsupported_content_encoding",
        headers={"Accept-Encoding": "identity"},
    )


def _default_to_json(scope: Scope) -> None:
    """Every POST body here is JSON; read it as such even when the client labels it otherwise
    (``curl -d`` sends form encoding) instead of failing on the label."""
    ctype = _header(scope, b"content-type")
    if ctype is None or b"json" not in ctype.lower():
        headers = [h for h in scope.get("headers", []) if h[0] != b"content-type"]
        headers.append((b"content-type", b"application/json"))
        scope["headers"] = headers


def _too_large(limit: int) -> APIError:
    return APIError(413, f"Request body is larger than the limit of {limit} bytes.", code="request_too_large")


class EdgeMiddleware:
    """Assigns/echoes ``X-Request-Id``, enforces the API key and ``max_request_bytes`` (``max_file_bytes``
    for an upload to ``/v1/files``, whose multipart content type is left as it is).

    The body is read here, counted as it streams in (Content-Length alone can lie or be
    absent with chunked encoding) and replayed to the app; after the replay, ``receive``
    is the server's own, so disconnects still reach the handlers. An upload is not buffered: it
    is only counted as the app reads it (413 raised from ``receive`` once past the limit).

    The buffered body is also left in ``scope["state"]["body"]`` for ``GenerationRoutes``.
    A generation request whose body is in is ``announce``d to the engine (``AsyncEngine.announce``)
    before the app parses it; the handler marks it submitted through ``scope["state"]["submitted"]``,
    and leaving the app does so for one that never got that far.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: str | None,
        max_request_bytes: int,
        max_file_bytes: int | None = None,
        announce: Callable[[], Callable[[], None]] | None = None,
        load: ServerLoad | ReplicaLoad | None = None,
    ) -> None:
        self.app = app
        self.load = load if load is not None else ServerLoad()
        self.api_key = api_key.encode() if api_key else None
        self.max_request_bytes = max_request_bytes
        self.max_file_bytes = max_file_bytes if max_file_bytes is not None else max_request_bytes
        self.announce = announce

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_of(_header(scope, REQUEST_ID_HEADER))
        scope.setdefault("state", {})["request_id"] = request_id
        # Its W3C trace context, for the spans of its engine requests (server/tracing.py); set for
        # every request, so a batch line run from a traced request's task has its own, or none.
        set_request_trace(trace_headers(scope["headers"]))

        if self.api_key is not None and route_path(scope).startswith(_PROTECTED_PREFIXES):
            auth = _header(scope, b"authorization") or b""
            # Anthropic's SDKs send the key as x-api-key (the Messages API): taken as well.
            anthropic = _header(scope, b"x-api-key") or b""
            bearer_ok = hmac.compare_digest(auth, b"Bearer " + self.api_key)
            if not (bearer_ok or hmac.compare_digest(anthropic, self.api_key)):
                error = APIError(401, "Invalid or missing API key.", code="invalid_api_key")
                await _send_error(send, error, request_id, is_messages(scope))
                return

        if scope["method"] in ("POST", "PUT", "PATCH"):
            coding = unsupported_encoding(scope)
            if coding is not None:
                await _send_error(send, unsupported_encoding_error(coding), request_id, is_messages(scope))
                return
            if route_path(scope) == _UPLOAD_PATH:
                # Up to --max-file-bytes: counted as it streams to the Files API, which spools it
                # to disk (buffered here, it would be held in memory whole).
                receive = await self._limit_body(scope, receive, send, request_id, self.max_file_bytes)
            else:
                receive = await self._buffer_body(scope, receive, send, request_id, self.max_request_bytes)
                _default_to_json(scope)
            if receive is None:
                return

        id_headers = [REQUEST_ID_HEADER, *([ANTHROPIC_REQUEST_ID_HEADER] if is_messages(scope) else [])]

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0].lower() not in id_headers]
                headers += [(name, request_id.encode()) for name in id_headers]
                message["headers"] = headers
            await send(message)

        path = route_path(scope)
        tracked = scope["method"] == "POST" and path in _LOAD_PATHS
        self.load.requests += tracked
        try:
            if self.announce is None or scope["method"] != "POST" or path not in _GENERATION_PATHS:
                await self.app(scope, receive, send_with_id)
                return
            submitted = self.announce()
            scope["state"]["submitted"] = submitted
            try:
                await self.app(scope, receive, send_with_id)
            finally:
                submitted()
        finally:
            self.load.requests -= tracked

    async def _limit_body(
        self, scope: Scope, receive: Receive, send: Send, request_id: str, limit: int
    ) -> Receive | None:
        """``receive``, raising the 413 (``APIError``, answered by the app's handler) as soon as
        more than ``limit`` bytes came in; None after a 413 for a declared length over it."""
        if await self._declared_too_large(scope, send, request_id, limit):
            return None
        size = 0

        async def counted() -> Message:
            nonlocal size
            message = await receive()
            size += len(message.get("body", b""))
            if size > limit:
                raise _too_large(limit)
            return message

        return counted

    @staticmethod
    async def _declared_too_large(scope: Scope, send: Send, request_id: str, limit: int) -> bool:
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _send_error(send, _too_large(limit), request_id, is_messages(scope))
            return True
        return False

    async def _buffer_body(
        self, scope: Scope, receive: Receive, send: Send, request_id: str, limit: int
    ) -> Receive | None:
        if await self._declared_too_large(scope, send, request_id, limit):
            return None
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _send_error(send, _too_large(limit), request_id, is_messages(scope))
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        scope["state"]["body"] = body
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return replay
