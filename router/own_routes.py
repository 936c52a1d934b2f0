"""The routes the router answers itself, from what it knows of its replicas (nothing relayed).

``/health`` (and SageMaker's ``/ping``): 200 while the pool that serves whole requests has a
routable replica, else 503; the body counts every replica and each role's. ``/v1/models`` and
``/v1/models/{id}``: the replicas' lists, merged; a replica that does not answer in time is
represented by the list the prober last read from it (``Replica.model_cards``), and when no
replica can be represented at all the answer is 503 with ``Retry-After`` (as when none is
routable), never an empty list or a 404 that would say the model is gone. vLLM's ``/version``
(the router's own version), ``/load`` (the requests the router holds: relayed or waiting for an
admission slot), ``/is_sleeping`` (true when every healthy replica's engine sleeps, as their
probes last said: the router then serves nothing without waking one; each replica's state in
``replicas``) and ``/openapi.json`` (the router's own routes, with the request schemas of the
generation routes it parses). ``POST /reset_prefix_cache`` (vLLM's admin route) is fanned out to
every replica.
"""

from __future__ import annotations

import asyncio
import functools
from typing import TYPE_CHECKING, Any

from ferry import __version__
from router.health import model_list
from router.http import Scope, Send, error_body, send_bytes, send_error, send_json
from router.pool import counts
from router.replica import Health, Replica
from router.upstream import UpstreamError, fetch

if TYPE_CHECKING:
    from router.app import RouterApp

RETRY_AFTER = [(b"retry-after", b"1")]
OWN_PATHS = frozenset({"/health", "/ping", "/version", "/load", "/is_sleeping", "/openapi.json"})


async def answer_own(app: RouterApp, path: str, send: Send) -> None:
    """One of ``OWN_PATHS``."""
    if path in ("/health", "/ping"):  # /ping: SageMaker's health check
        await _health(app, send)
    elif path == "/version":
        await send_json(send, 200, {"version": __version__})
    elif path == "/load":
        await send_json(send, 200, {"server_load": app.admission.active + app.admission.queued})
    elif path == "/is_sleeping":
        await _is_sleeping(app, send)
    else:
        await send_json(send, 200, openapi())


async def _health(app: RouterApp, send: Send) -> None:
    now = app.clock()
    status = 200 if app.pool.counts(now)["routable"] else 503
    pools = app.replicas.pools
    body = {
        "status": "ok" if status == 200 else "unavailable",
        "replicas": counts(app.replicas, now),
        "roles": {role: pool.counts(now) for role, pool in pools.items() if len(pool)},
    }
    await send_json(send, status, body)


async def _is_sleeping(app: RouterApp, send: Send) -> None:
    healthy = [r for r in app.replicas if r.health is Health.HEALTHY]
    if not healthy:
        await send_error(send, 503, "no healthy replica is registered with this router", RETRY_AFTER)
        return
    body = {
        "is_sleeping": all(r.sleeping for r in healthy),
        "replicas": {r.url: r.sleeping for r in healthy},
    }
    await send_json(send, 200, body)


async def answer_models(app: RouterApp, scope: Scope, send: Send, model: str | None) -> None:
    """``GET /v1/models``: every routable replica's list, merged; ``GET /v1/models/{model}``: one card."""
    replicas = app.pool.candidates(app.clock())
    if not replicas:
        await send_error(send, 503, "no healthy replica is registered with this router yet", RETRY_AFTER)
        return
    headers = app.auth_headers(scope)

    async def one(r: Replica) -> list[dict] | None:
        return await model_list(app.client, r.url, headers, app.config.health_timeout)

    merged: dict[str, dict] = {}
    unknown = 0  # replicas with neither an answer now nor a list read before
    for r, live in zip(replicas, await asyncio.gather(*(one(r) for r in replicas)), strict=True):
        cards = live if live is not None else (r.model_cards or None)
        if cards is None:
            unknown += 1
            continue
        for m in cards:
            merged.setdefault(m["id"], m)
    if unknown == len(replicas) or (model is not None and model not in merged and unknown):
        message = f"no replica answered /v1/models in time ({unknown} of {len(replicas)} did not); retry"
        await send_error(send, 503, message, RETRY_AFTER)
    elif model is None:
        await send_json(send, 200, {"object": "list", "data": list(merged.values())})
    elif model in merged:
        await send_json(send, 200, merged[model])
    else:
        body = error_body(f"The model `{model}` does not exist.", "NotFoundError", "model_not_found", "model")
        await send_bytes(send, 404, body)


# (path, method, summary, request schema): the router's routes, for /openapi.json.
_ROUTES: tuple[tuple[str, str, str, str | None], ...] = (
    ("/v1/chat/completions", "post", "Chat completion (relayed; streams resumed on failover)", "chat"),
    ("/v1/completions", "post", "Completion (relayed; streams resumed on failover)", "completion"),
    ("/v1/messages", "post", "Anthropic Messages (relayed; streams resumed on failover)", "messages"),
    ("/v1/responses", "post", "Responses API (relayed; streams resumed on failover)", None),
    ("/v1/embeddings", "post", "Embeddings (relayed)", None),
    ("/v1/models", "get", "The replicas' models, merged", None),
    ("/v1/models/{model}", "get", "One model card", None),
    ("/tokenize", "post", "Tokenize (relayed)", None),
    ("/detokenize", "post", "Detokenize (relayed)", None),
    ("/score", "post", "Score (relayed)", None),
    ("/rerank", "post", "Rerank (relayed)", None),
    ("/v2/rerank", "post", "Rerank, Cohere's shape (relayed)", None),
    ("/classify", "post", "Classify (relayed)", None),
    ("/pooling", "post", "Pooling: raw pooler output (relayed)", None),
    ("/invocations", "post", "SageMaker invocations (relayed)", None),
    ("/inference/v1/generate", "post", "vLLM's tokens-in/tokens-out generate (relayed, retried)", None),
    ("/reset_prefix_cache", "post", "Every replica drops its cached KV blocks", None),
    ("/health", "get", "200 while a replica takes traffic, else 503", None),
    ("/ping", "get", "SageMaker's health check (as /health)", None),
    ("/metrics", "get", "Prometheus metrics (ferry:router_*)", None),
    ("/version", "get", "The router's version", None),
    ("/load", "get", "Requests the router holds (relayed or queued)", None),
    ("/is_sleeping", "get", "Whether every healthy replica's engine sleeps", None),
    ("/openapi.json", "get", "This document", None),
    ("/admin/replicas", "get", "List replicas (admin)", None),
    ("/admin/replicas", "post", "Add a replica {url, role} (admin)", None),
    ("/admin/replicas", "delete", "Remove a replica {url} (admin)", None),
    ("/admin/replicas/drain", "post", "Drain a replica {url} (admin)", None),
)


@functools.cache
def openapi() -> dict[str, Any]:
    """The router's OpenAPI document (built once, on first use: the schemas take ~0.1 s)."""
    from pydantic.json_schema import models_json_schema

    from server.anthropic_protocol import MessagesRequest
    from server.chat_protocol import ChatCompletionRequest
    from server.completion_protocol import CompletionRequest

    models = {"chat": ChatCompletionRequest, "completion": CompletionRequest, "messages": MessagesRequest}
    refs, schemas = models_json_schema(
        [(m, "validation") for m in models.values()], ref_template="#/components/schemas/{model}"
    )
    paths: dict[str, dict[str, Any]] = {}
    for path, method, summary, body in _ROUTES:
        op: dict[str, Any] = {"summary": summary, "responses": {"200": {"description": "OK"}}}
        if body is not None:
            schema = refs[(models[body], "validation")]
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
        paths.setdefault(path, {})[method] = op
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "ferry router",
            "version": __version__,
            "description": "One OpenAI-compatible endpoint over ferry replicas; every other /v1/* "
            "route is relayed to a replica as it is.",
        },
        "paths": paths,
        "components": {"schemas": schemas.get("$defs", {})},
    }


async def reset_prefix_cache(app: RouterApp, scope: Scope, send: Send) -> None:
    """vLLM's admin route, fanned out: every replica of every pool drops its cached blocks.
    200 when all did, else the first non-200 status (409 = a replica was busy), with each
    replica's status in ``replicas`` so a caller can retry. The query (vLLM's
    ``reset_running_requests=true``) goes to every replica as sent."""
    headers = app.auth_headers(scope)
    replicas = list(app.replicas)
    query = scope.get("query_string", b"").decode("latin-1")
    target = "/reset_prefix_cache" + (f"?{query}" if query else "")

    async def one(r: Replica) -> int:
        try:
            fetched = fetch(app.client, "POST", r.url, target, headers)
            status, _ = await asyncio.wait_for(fetched, app.config.health_timeout)
        except (UpstreamError, asyncio.TimeoutError):
            return 502
        if status == 200:  # it holds no cached blocks now: cache_aware must not count on them
            app.replicas.cache_lost(r)
            r.prefix_cache_resets = None  # the next probe reads the new count (no second drop)
        return status

    statuses = await asyncio.gather(*(one(r) for r in replicas))
    failed = [st for st in statuses if st != 200]
    status = failed[0] if failed else (200 if replicas else 503)
    body = {"replicas": {r.url: st for r, st in zip(replicas, statuses, strict=True)}}
    await send_json(send, status, body)
