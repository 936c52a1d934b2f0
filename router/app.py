"""The router as an ASGI application: routes, limits, auth, and the request life cycle.

``RouterApp(config)`` is a plain ASGI callable (served by uvicorn in ``router/main.py``).
Generation requests (``/v1/chat/completions``, ``/v1/completions``) are parsed once, keyed for the policy, admitted by overload control and
handed to the ``Relay``; every other ``/v1/*`` route and the root routes of ``FORWARD_ROOT_PATHS``
(``/tokenize``, ``/score``, ``/rerank``…) are relayed as they are; the Files and Batches API
(``/v1/files*``, ``/v1/batches*``) all to one replica (``batch_home``). While a request is relayed the
app watches the client: if it disconnects, the relay is cancelled at once, which closes the
upstream connection and frees the replica's work. What the router answers itself (``/health``,
``/v1/models``, ``/version``, ``/load``…) is in ``router/own_routes.py``. Every answer carries the
request's ``X-Request-Id`` (the client's, else a new one), relayed or the router's own.
This module must never import torch (the router starts in well under a second).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any
from urllib.parse import unquote

from router.admin import handle_admin
from router.admission import Admission
from router.config import RouterConfig
from router.discovery import make_discovery
from router.discovery_sync import DiscoverySync
from router.generation import Generation
from router.health import HealthChecker
from router.http import (
    BodyTooLarge,
    ClientGone,
    Message,
    Receive,
    Scope,
    Send,
    bearer_ok,
    forward_headers,
    header,
    read_body,
    send_bytes,
    send_error,
    send_json,
)
from router.kv_events import KVEventFollower
from router.messages_stream import anthropic_errors
from router.metrics import RouterMetrics
from router.own_routes import OWN_PATHS, answer_models, answer_own
from router.pd import PDOrchestrator
from router.pd_config import PDConfig, PDMetrics
from router.policies import RouteRequest, make_policy
from router.policies.cache_aware import CacheAware
from router.pool import Pool, Replicas
from router.prompt_keys import PromptKeyer, make_keyer, prompt_keys
from router.relay import ProxyCall
from router.replica import HealthPolicy, Replica
from router.response_affinity import (
    RESPONSES_PATH,
    ResponseAffinity,
    batch_home,
    is_batch_path,
)
from router.retry import RetryPolicy
from router.upstream import UpstreamClient, UpstreamError, fetch
from server.middleware import (
    request_id_of,
    route_path,
    unsupported_encoding,
    unsupported_encoding_error,
)

log = logging.getLogger("ferry.router")

GENERATE_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
# Anthropic's Messages API: whole answers retried, streams resumed (router/messages_stream.py).
MESSAGES_PATH = "/v1/messages"
# Routed by their prompt (parsed and keyed). The Responses API's streams are resumed
# (router/responses_stream.py); its other answers (whole, background) are relayed as they come,
# retried before their first byte.
KEYED_PATHS = GENERATE_PATHS | {"/v1/responses", MESSAGES_PATH}
# Relayed as they come, like every /v1/* route: vLLM serves these outside /v1 (scoring: /score,
# /rerank, Cohere's /v2/rerank; /classify; /pooling; SageMaker's /invocations, any request on one path).
FORWARD_ROOT_PATHS = frozenset(
    {"/tokenize", "/detokenize", "/score", "/rerank", "/v2/rerank", "/classify", "/pooling", "/invocations"}
)


def _session_of(body: dict) -> str | None:
    """A body's own session key (after the ``X-Session-Id`` header): OpenAI's ``prompt_cache_key``
    (which its clients set to keep a conversation on one cache), ``user`` or ``safety_identifier``,
    or the Messages API's ``metadata.user_id``."""
    for field in ("prompt_cache_key", "user", "safety_identifier"):
        if isinstance(body.get(field), str) and body[field]:
            return body[field]
    metadata = body.get("metadata")
    user_id = metadata.get("user_id") if isinstance(metadata, dict) else None
    return user_id if isinstance(user_id, str) and user_id else None


class RouterApp:
    def __init__(
        self,
        config: RouterConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        pd: PDConfig | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.metrics = RouterMetrics()
        self.replicas = Replicas(
            HealthPolicy(
                probe_interval=config.health_interval,
                probe_backoff_max=min(8.0, max(1.0, 4 * config.health_interval)),
                circuit_failures=config.circuit_failures,
                circuit_cooldown=config.circuit_cooldown,
            ),
            clock=clock,
        )
        options: dict[str, Any] = {}
        if config.policy == "cache_aware":
            options = {
                "block_size": config.block_size,
                "balance_abs_threshold": config.balance_abs_threshold,
                "load_penalty_tokens": config.load_penalty_tokens,
                "decode_penalty_tokens": config.decode_penalty_tokens,
                "prefix_index_size": config.prefix_index_size,
            }
        self.policy = make_policy(config.policy, **options)
        self.keyer: PromptKeyer | None = (
            make_keyer(
                config.model,
                config.block_size,
                self.replicas.lora_extra,
                config.chat_template,
                config.chat_template_content_format,
                config.chat_defaults,
            )
            if self.policy.needs_prefix
            else None
        )
        # Probes and /v1/models get a client of their own: short timeouts, never queued behind traffic.
        ca = config.replica_ca_certs
        self.client = UpstreamClient(config.health_timeout, config.health_timeout, 4, ca)
        self.upstream = UpstreamClient(config.connect_timeout, config.request_timeout, ca_certs=ca)
        self.relay = Generation(
            self.upstream,
            self.policy,
            self.metrics,
            RetryPolicy(max_retries=config.max_retries),
            max_failovers=config.max_failovers,
            clock=clock,
        )
        self.pd = self._build_pd(pd or PDConfig())
        self.admission = Admission(config.max_concurrency, config.max_queue, config.queue_timeout)
        # The key the replicas want (--replica-api-key, else the router's own --api-key): on the
        # router's own reads of them, and instead of the client's on what it relays.
        replica_key = config.replica_api_key or config.api_key
        self.replica_auth = [(b"authorization", f"Bearer {replica_key}".encode())] if replica_key else []
        self.health = HealthChecker(
            self.replicas, self.client, self.metrics, config.health_timeout, clock, self.replica_auth
        )
        self.discovery = (
            DiscoverySync(make_discovery(config.discovery), self.replicas, config.discovery_interval)
            if config.discovery
            else None
        )
        self.kv_events: KVEventFollower | None = None
        if (
            config.kv_tier
            and config.kv_tier.startswith(("redis://", "rediss://"))
            and isinstance(self.policy, CacheAware)
        ):
            self.kv_events = KVEventFollower(
                config.kv_tier,
                self.policy.index,
                lambda u: self.replicas.find(u) is not None,
                instance_of=self._instance_of,
                counter=self.metrics.kv_events,
                gap_counter=self.metrics.kv_event_gaps,
            )
        self.replicas.on_removed.append(self._forget)
        self.replicas.on_cache_lost.append(self._cache_lost)
        for role, urls in (
            ("mixed", config.replicas),
            ("prefill", config.prefill),
            ("decode", config.decode),
        ):
            for url in urls:
                self.replicas.add(url, role, source="static")
        self.responses = ResponseAffinity()
        self.started = False

    def _build_pd(self, pd: PDConfig) -> PDOrchestrator:
        """Prefill/decode orchestration (``router/pd.py``): each pool with its own policy; the
        prefill pool with its own timeout (a slow prefill worker is replaced, not waited for)."""
        config = self.config

        def policy(name: str) -> Any:
            if name != "cache_aware":
                return make_policy(name)
            # One prefix index for the router: the block events it follows (--kv-tier) land there.
            shared = {"index": self.policy.index} if isinstance(self.policy, CacheAware) else {}
            return make_policy(
                name,
                **shared,
                block_size=config.block_size,
                balance_abs_threshold=config.balance_abs_threshold,
                load_penalty_tokens=config.load_penalty_tokens,
                decode_penalty_tokens=config.decode_penalty_tokens,
                prefix_index_size=config.prefix_index_size,
            )

        retry = RetryPolicy(max_retries=config.max_retries)
        prefill = Generation(
            UpstreamClient(config.connect_timeout, pd.prefill_timeout, ca_certs=config.replica_ca_certs),
            policy(pd.prefill_policy),
            self.metrics,
            retry,
            max_failovers=0,
            clock=self.clock,
        )
        decode = Generation(
            self.upstream,
            policy(pd.decode_policy),
            self.metrics,
            retry,
            max_failovers=config.max_failovers,
            clock=self.clock,
        )
        keyer = self.keyer or make_keyer(
            config.model,
            config.block_size,
            self.replicas.lora_extra,
            config.chat_template,
            config.chat_template_content_format,
            config.chat_defaults,
        )
        return PDOrchestrator(pd, prefill, decode, keyer, PDMetrics(self.metrics.registry), config.block_size)

    @property
    def disaggregated(self) -> bool:
        """Generation requests go prefill -> decode while both pools have workers."""
        pools = self.replicas.pools
        return bool(len(pools["prefill"]) and len(pools["decode"]))

    async def _generate(self, pool: Pool, call: ProxyCall, send: Send) -> None:
        if self.disaggregated:
            pools = self.replicas.pools
            mixed = (self.relay, pools["mixed"]) if len(pools["mixed"]) else None
            await self.pd.generate(pools["prefill"], pools["decode"], call, send, whole=mixed)
        else:
            await self.relay.generate(pool, call, send)

    def _forget(self, replica: Replica) -> None:
        self.policy.on_replica_removed(replica.url)
        for gen in (self.pd.prefill, self.pd.decode):
            gen.policy.on_replica_removed(replica.url)
        self.metrics.forget_replica(replica.url)
        if self.kv_events is not None:
            self.kv_events.forget(replica.url)

    def _cache_lost(self, replica: Replica, restarted: bool) -> None:
        follower = self.kv_events
        if follower is not None and restarted:
            # Its events may have shown the new instance first: the follower keeps those blocks.
            follower.restarted(replica.url, replica.instance_id)
        elif follower is not None and not follower.follows(replica.url):
            follower = None  # a reset of a replica whose events say nothing: forget what it held
        # else a reset of a replica whose events are followed: they say which blocks went (kv_events.py)
        for policy in (self.policy, self.pd.prefill.policy, self.pd.decode.policy):
            if follower is None or getattr(policy, "index", None) is not follower.index:
                policy.on_cache_lost(replica.url)

    def _instance_of(self, url: str) -> str | None:
        replica = self.replicas.find(url)
        return replica.instance_id if replica is not None else None

    @property
    def pool(self) -> Pool:
        """The pool that serves whole requests: the mixed replicas; in a cluster of only prefill and
        decode workers, the decode pool (then the prefill one), used when a request is not
        disaggregated (a PD router's local-prefill path goes through router/pd.py)."""
        pools = self.replicas.pools
        for role in ("mixed", "decode", "prefill"):
            if len(pools[role]):
                return pools[role]
        return pools["mixed"]

    # ---- life cycle ---------------------------------------------------------------------------
    async def startup(self) -> None:
        if not self.config.replicas and bool(self.config.prefill) != bool(self.config.decode):
            log.warning(
                "no mixed replicas: requests are served whole by the %s pool (no prefill->decode hand-off)",
                "decode" if self.config.decode else "prefill",
            )
        if self.discovery is not None:
            with contextlib.suppress(Exception):
                await self.discovery.sync_once()
        await self.health.probe_all(timeout=min(self.config.health_timeout, 1.0))
        self.health.start()
        if self.discovery is not None:
            self.discovery.start()
        if self.kv_events is not None:
            self.kv_events.start()
        self.started = True

    async def shutdown(self) -> None:
        await self.health.stop()
        if self.kv_events is not None:
            await self.kv_events.stop()
        if self.discovery is not None:
            await self.discovery.stop()
        await self.client.aclose()
        await self.upstream.aclose()
        await self.pd.prefill.client.aclose()

    # ---- ASGI ---------------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            if scope.get("root_path"):
                # --root-path: uvicorn puts the prefix in front of every path (a proxy that strips it
                # is expected); one that forwards it adds it twice. Route (and relay) without it.
                path = route_path(scope)
                scope = {**scope, "path": route_path({**scope, "path": path})}
            await self.handle(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as e:
                    await send({"type": "lifespan.startup.failed", "message": str(e)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        request_id = request_id_of(header(scope, b"x-request-id"))
        if path.startswith(MESSAGES_PATH):  # the router's own errors in Anthropic's shape there too
            send = anthropic_errors(send)
        relayed = path.startswith("/v1/") or path in FORWARD_ROOT_PATHS
        models = relayed and method == "GET" and (path == "/v1/models" or path.startswith("/v1/models/"))
        if not relayed or models:
            send = _with_request_id(send, request_id)  # (relayed answers name it themselves)
        id_header = [(b"x-request-id", request_id.encode())]
        reset = path == "/reset_prefix_cache" and method == "POST"
        guarded = relayed or reset
        if guarded and self.config.api_key is not None and not bearer_ok(scope, self.config.api_key):
            await send_error(send, 401, "missing or wrong API key (Authorization: Bearer …)", id_header)
            return
        if models:
            await answer_models(self, scope, send, unquote(path[len("/v1/models/") :]) or None)
        elif relayed:
            await self._proxy(scope, receive, send, request_id)
        elif reset:
            await self._reset_prefix_cache(scope, send)
        elif path in OWN_PATHS:
            await answer_own(self, path, send)
        elif path == "/metrics":
            await send_bytes(send, 200, self.metrics.render(), content_type=b"text/plain; version=0.0.4")
        elif path.startswith("/admin/"):
            await handle_admin(self, scope, receive, send)
        else:
            await send_error(send, 404, f"no route {path}")

    def auth_headers(self, scope: Scope) -> list[tuple[bytes, bytes]]:
        """What authorizes a call the router makes for a client: the replicas' key when the router
        has one (``--replica-api-key``), else the client's own header."""
        if self.replica_auth:
            return list(self.replica_auth)
        auth = header(scope, b"authorization")
        return [(b"authorization", auth)] if auth else []

    async def _reset_prefix_cache(self, scope: Scope, send: Send) -> None:
        """vLLM's admin route, fanned out: every replica of every pool drops its cached blocks.
        200 when all did, else the first non-200 status (409 = a replica was busy), with each
        replica's status in ``replicas`` so a caller can retry."""
        headers = self.auth_headers(scope)
        replicas = list(self.replicas)

        async def one(r: Replica) -> int:
            try:
                fetched = fetch(self.client, "POST", r.url, "/reset_prefix_cache", headers)
                status, _ = await asyncio.wait_for(fetched, self.config.health_timeout)
            except (UpstreamError, asyncio.TimeoutError):
                return 502
            if status == 200:  # it holds no cached blocks now: cache_aware must not count on them
                self.replicas.cache_lost(r)
                r.prefix_cache_resets = None  # the next probe reads the new count (no second drop)
            return status

        statuses = await asyncio.gather(*(one(r) for r in replicas))
        failed = [st for st in statuses if st != 200]
        status = failed[0] if failed else (200 if replicas else 503)
        body = {"replicas": {r.url: st for r, st in zip(replicas, statuses, strict=True)}}
        await send_json(send, status, body)

    async def _proxy(self, scope: Scope, receive: Receive, send: Send, request_id: str) -> None:
        id_header = [(b"x-request-id", request_id.encode())]
        coding = unsupported_encoding(scope)
        if coding is not None:  # as a replica answers it, before a keyed body fails to parse
            error = unsupported_encoding_error(coding)
            headers = [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
            await send_error(send, error.status, error.message, headers + id_header, error.code)
            return
        length = header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.config.max_request_bytes:
            await send_error(
                send, 413, f"request body exceeds {self.config.max_request_bytes} bytes", id_header
            )
            return
        try:
            body = await read_body(receive, self.config.max_request_bytes)
        except BodyTooLarge:
            await send_error(
                send, 413, f"request body exceeds {self.config.max_request_bytes} bytes", id_header
            )
            return
        except ClientGone:
            return
        path = scope["path"]
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
                await send_error(send, 400, f"request body is not valid JSON: {e}", id_header)
                return
            except RecursionError:  # [[[[…: json's recursion, a client's error as the replica's
                await send_error(send, 400, "request body is not valid JSON: nested too deeply", id_header)
                return
            if not isinstance(parsed, dict):
                await send_error(send, 400, "request body must be a JSON object", id_header)
                return
            if route.session_key is None:
                route.session_key = _session_of(parsed)
            if isinstance(parsed.get("model"), str):
                route.model = parsed["model"]
            if self.keyer is not None:
                hashes, tokens = await prompt_keys(self.keyer, path, parsed, len(body))
                route.block_hashes = hashes
                route.prompt_tokens = tokens or route.prompt_tokens
        headers = forward_headers(scope)
        if self.replica_auth:  # the router checked the client's key; replicas get theirs
            headers = [
                (k, v) for k, v in headers if k not in (b"authorization", b"x-api-key")
            ] + self.replica_auth
        headers.append((b"x-request-id", request_id.encode()))
        headers.append((b"accept-encoding", b"identity"))
        call = ProxyCall(
            scope["method"], path, scope.get("query_string", b""), headers, body, request_id, route, parsed
        )
        self._follow_responses(call)
        if is_batch_path(path):
            call.route.prefer_url = batch_home(self.pool.candidates(self.clock()))

        if generate:
            relay = self._generate
        elif path == MESSAGES_PATH and scope["method"] == "POST":
            relay = self.relay.messages
        elif (
            path == RESPONSES_PATH
            and parsed is not None
            and parsed.get("stream")
            and not parsed.get("background")
        ):
            relay = self.relay.responses_stream
        else:
            relay = self.relay.forward
        await _until_disconnect(self._admitted(relay, call, send, id_header), receive)

    def _follow_responses(self, call: ProxyCall) -> None:
        """Send what names a stored response or item to the replica that holds it, and remember who
        answers new ones (``router/response_affinity.py``)."""
        if not self.responses.follow(call):
            self.metrics.response_affinity.labels("miss").inc()

    async def _admitted(
        self,
        relay: Callable[[Pool, ProxyCall, Send], Awaitable[None]],
        call: ProxyCall,
        send: Send,
        id_header: list[tuple[bytes, bytes]],
    ) -> None:
        """Wait for a slot (cancelled with the rest if the client leaves while queued), then relay."""
        if not await self.admission.try_acquire():
            self.metrics.rejected.inc()
            await send_error(
                send,
                429,
                "the router is at its concurrency and queue limits; retry later",
                [(b"retry-after", b"1"), *id_header],
            )
            return
        status = 0  # of the answer's head, once sent

        async def watched(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        outcome = "client_gone"  # unless it ends otherwise: the task is cancelled when the client leaves
        try:
            await relay(self.pool, call, watched)
            outcome = "error" if call.broken or status >= 500 else "ok"
        except asyncio.CancelledError:
            raise
        except Exception:
            outcome = "error"
            raise
        finally:
            self.admission.release()
            # Every admitted request, however it ended (RouterMetrics.OUTCOMES).
            self.metrics.observe_latency(time.perf_counter() - call.started, outcome)


def _with_request_id(send: Send, request_id: str) -> Send:
    """``send`` with ``X-Request-Id`` on the answer's head, unless the answer names one already."""
    value = request_id.encode()

    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", []))
            if not any(k.lower() == b"x-request-id" for k, _ in headers):
                message = {**message, "headers": [*headers, (b"x-request-id", value)]}
        await send(message)

    return wrapped


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
