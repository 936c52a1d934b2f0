"""The relayed requests: every ``/v1/*`` route and the root routes of ``FORWARD_ROOT_PATHS``.

``proxy(app, …)`` reads a request's body (within ``--max-request-bytes``), parses and keys the
generation routes' prompts for the policy (``KEYED_PATHS``: session, model, block hashes), sends
what names a stored response or batch to the replica that holds it, waits for an admission slot
and hands the call to the ``Relay`` (``router/generation.py``), cancelling it as soon as the
client disconnects (which closes the upstream connection and frees the replica's work).
This module must never import torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

from router.http import (
    BodyTooLarge,
    ClientGone,
    Message,
    Receive,
    Scope,
    Send,
    forward_headers,
    header,
    read_body,
    send_error,
)
from router.policies import RouteRequest
from router.pool import Pool
from router.prompt_keys import TOKENS_GENERATE_PATH, prompt_keys
from router.relay import ProxyCall
from router.response_affinity import RESPONSES_PATH, batch_home, is_batch_path
from router.tracing import end_request, refused, start_request
from server.middleware import request_id_of, unsupported_encoding, unsupported_encoding_error

if TYPE_CHECKING:
    from router.app import RouterApp

GENERATE_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
# Anthropic's Messages API: whole answers retried, streams resumed (router/messages_stream.py).
MESSAGES_PATH = "/v1/messages"
# Routed by their prompt (parsed and keyed). The Responses API's streams are resumed
# (router/responses_stream.py); its other answers (whole, background) are relayed as they come,
# retried before their first byte. vLLM's tokens-in/tokens-out generate is keyed by its token ids
# and answered by ``Generation.tokens_generate`` (whole answers retried, streams resumed), never by
# the prefill/decode hand-off (it refuses ``kv_transfer_params``); its render routes are /v1/*,
# relayed as they come.
KEYED_PATHS = GENERATE_PATHS | {"/v1/responses", MESSAGES_PATH, TOKENS_GENERATE_PATH}
# Relayed as they come, like every /v1/* route: vLLM serves these outside /v1 (scoring: /score,
# /rerank, Cohere's /v2/rerank; /classify; /pooling; SageMaker's /invocations, any request on one path;
# /inference/v1/generate, which is keyed: KEYED_PATHS).
# A file upload: bounded by --max-file-bytes (a batch's input), not --max-request-bytes.
FILES_PATH = "/v1/files"
FORWARD_ROOT_PATHS = frozenset(
    {
        "/tokenize",
        "/detokenize",
        "/score",
        "/rerank",
        "/v2/rerank",
        "/classify",
        "/pooling",
        "/invocations",
        "/inference/v1/generate",
    }
)


def _session_of(body: dict) -> str | None:
    """A body's own session key (after the ``X-Session-Id`` header): vLLM's ``session_id``, OpenAI's
    ``prompt_cache_key`` (which its clients set to keep a conversation on one cache), ``user`` or
    ``safety_identifier``, or the Messages API's ``metadata.user_id``."""
    for field in ("session_id", "prompt_cache_key", "user", "safety_identifier"):
        if isinstance(body.get(field), str) and body[field]:
            return body[field]
    metadata = body.get("metadata")
    user_id = metadata.get("user_id") if isinstance(metadata, dict) else None
    return user_id if isinstance(user_id, str) and user_id else None


async def refuse(
    app: RouterApp,
    scope: Scope,
    send: Send,
    request_id: str,
    status: int,
    message: str,
    headers: list[tuple[bytes, bytes]],
    code: str | None = None,
    started: float | None = None,
) -> None:
    """Answer a request the router will not relay (a client error) with ``status``; with tracing,
    its span says so (``router.tracing.refused``)."""
    await send_error(send, status, message, headers, code)
    if app.tracing is not None:
        started = time.perf_counter() if started is None else started
        method, path = scope["method"], scope["path"]
        refused(
            app.tracing,
            method,
            path,
            scope["headers"],
            request_id,
            started,
            status,
            message,
            app.config.policy,
        )


async def proxy(app: RouterApp, scope: Scope, receive: Receive, send: Send, request_id: str) -> None:
    started = time.perf_counter()
    id_header = [(b"x-request-id", request_id.encode())]

    async def client_error(
        status: int, message: str, headers: list[tuple[bytes, bytes]] | None = None, code: str | None = None
    ) -> None:
        await refuse(app, scope, send, request_id, status, message, headers or id_header, code, started)

    coding = unsupported_encoding(scope)
    if coding is not None:  # as a replica answers it, before a keyed body fails to parse
        error = unsupported_encoding_error(coding)
        headers = [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
        await client_error(error.status, error.message, headers + id_header, error.code)
        return
    path = scope["path"]
    # A file upload (a batch's input) is bounded as the replica bounds it, not as a request is.
    upload = path == FILES_PATH and scope["method"] == "POST"
    limit, flag = (
        (app.config.max_file_bytes, "--max-file-bytes")
        if upload
        else (app.config.max_request_bytes, "--max-request-bytes")
    )
    too_large = f"request body exceeds {limit} bytes (the router's {flag})"
    length = header(scope, b"content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        await client_error(413, too_large)
        return
    try:
        body = await read_body(receive, limit)
    except BodyTooLarge:
        await client_error(413, too_large)
        return
    except ClientGone:
        return
    generate = path in GENERATE_PATHS and scope["method"] == "POST"
    keyed = path in KEYED_PATHS and scope["method"] == "POST"
    parsed: dict | None = None
    session = header(scope, b"x-session-id")  # empty (as some proxies send it): absent
    route = RouteRequest(
        request_id, session.decode("latin-1") if session else None, prompt_tokens=len(body) // 4
    )
    if keyed:
        try:
            parsed = json.loads(body)
        except ValueError as e:
            await client_error(400, f"request body is not valid JSON: {e}", code="invalid_json")
            return
        except RecursionError:  # [[[[…: json's recursion, a client's error as the replica's
            await client_error(400, "request body is not valid JSON: nested too deeply", code="invalid_json")
            return
        if not isinstance(parsed, dict):
            await client_error(400, "request body must be a JSON object")
            return
        if route.session_key is None:
            route.session_key = _session_of(parsed)
        if isinstance(parsed.get("model"), str):
            route.model = parsed["model"]
        if app.keyer is not None:
            hashes, tokens = await prompt_keys(app.keyer, path, parsed, len(body))
            route.block_hashes = hashes
            route.prompt_tokens = tokens or route.prompt_tokens
        if path == TOKENS_GENERATE_PATH and header(scope, b"x-request-id") is None:
            request_id = route.request_id = _generate_id(parsed, request_id)
            id_header = [(b"x-request-id", request_id.encode())]
    headers = forward_headers(scope)
    if app.replica_auth:  # the router checked the client's key; replicas get theirs
        headers = [(k, v) for k, v in headers if k not in (b"authorization", b"x-api-key")] + app.replica_auth
    headers.append((b"x-request-id", request_id.encode()))
    headers.append((b"accept-encoding", b"identity"))
    call = ProxyCall(
        scope["method"], path, scope.get("query_string", b""), headers, body, request_id, route, parsed
    )
    _follow_responses(app, call)
    if is_batch_path(path):
        call.route.prefer_url = batch_home(app.pool.candidates(app.clock()))

    if generate:
        relay = app.generate
    elif path == MESSAGES_PATH and scope["method"] == "POST":
        relay = app.relay.messages
    elif path == TOKENS_GENERATE_PATH and scope["method"] == "POST":
        relay = app.relay.tokens_generate
    elif (
        path == RESPONSES_PATH
        and parsed is not None
        and parsed.get("stream")
        and not parsed.get("background")
    ):
        relay = app.relay.responses_stream
    else:
        relay = app.relay.forward
    await _until_disconnect(_admitted(app, relay, call, send, id_header), receive)


def _generate_id(body: dict, request_id: str) -> str:
    """A generate request's id when its client sent no X-Request-Id: its body's ``request_id``, which a
    replica names the answer after (``generate-tokens-{request_id}``, as vLLM's) only when no
    X-Request-Id comes with it, and the router sends every replica one; else the router's own."""
    named = body.get("request_id")
    valid = isinstance(named, str) and request_id_of(named.encode("latin-1", "replace")) == named
    return named if valid else request_id


def _follow_responses(app: RouterApp, call: ProxyCall) -> None:
    """Send what names a stored response or item to the replica that holds it, and remember who
    answers new ones (``router/response_affinity.py``)."""
    if not app.responses.follow(call):
        app.metrics.response_affinity.labels("miss").inc()


async def _admitted(
    app: RouterApp,
    relay: Callable[[Pool, ProxyCall, Send], Awaitable[None]],
    call: ProxyCall,
    send: Send,
    id_header: list[tuple[bytes, bytes]],
) -> None:
    """Wait for a slot (cancelled with the rest if the client leaves while queued), then relay."""
    tracing = app.tracing
    if tracing is not None:
        start_request(tracing, call, app.config.policy)
    if not await app.admission.try_acquire():
        app.metrics.rejected.inc()
        busy = "the router is at its concurrency and queue limits; retry later"
        await send_error(send, 429, busy, [(b"retry-after", b"1"), *id_header])
        if tracing is not None:
            end_request(tracing, call, 429, "rejected", busy)
        return
    status = 0  # of the answer's head, once sent

    async def watched(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        await send(message)

    outcome = "client_gone"  # unless it ends otherwise: the task is cancelled when the client leaves
    try:
        await relay(app.pool, call, watched)
        outcome = "error" if call.broken or status >= 500 else "ok"
    except asyncio.CancelledError:
        raise
    except Exception:
        outcome = "error"
        raise
    finally:
        app.admission.release()
        # Every admitted request, however it ended (RouterMetrics.OUTCOMES).
        app.metrics.observe_latency(time.perf_counter() - call.started, outcome)
        if tracing is not None:
            end_request(tracing, call, status, outcome)


async def _until_disconnect(work: Coroutine[Any, Any, None], receive: Receive) -> None:
    """Run ``work``; if the client disconnects first, cancel it (closing the upstream request)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
