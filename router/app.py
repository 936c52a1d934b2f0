"""The router as an ASGI application: its parts, built from ``RouterConfig``; its life cycle; the routes.

``RouterApp(config)`` is a plain ASGI callable (served by uvicorn in ``router/main.py``). Built
here: the replica set and its health checks, discovery, the policy and its prompt keyer, the
relays (``router/generation.py``) and the prefill/decode orchestrator, admission, the KV event
follower; started and stopped with the ASGI lifespan. ``handle`` routes each request: every
``/v1/*`` route and the root routes of ``FORWARD_ROOT_PATHS`` (``/tokenize``, ``/score``,
``/rerank``…) are relayed (``router/proxy_route.py``: generation requests parsed once, keyed for
the policy, admitted by overload control and handed to the ``Relay``; the Files and Batches API
all to one replica; the relay cancelled as soon as the client disconnects). What the router
answers itself (``/health``, ``/v1/models``, ``/version``, ``/load``, ``/reset_prefix_cache``…) is
in ``router/own_routes.py``; the admin API in ``router/admin.py``. Every answer carries the
request's ``X-Request-Id`` (the client's, else a new one), relayed or the router's own.
This module must never import torch (the router starts in well under a second).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

from router.admin import handle_admin
from router.admission import Admission
from router.config import RouterConfig
from router.discovery import make_discovery
from router.discovery_sync import DiscoverySync
from router.generation import Generation
from router.health import HealthChecker
from router.http import Message, Receive, Scope, Send, bearer_ok, header, send_bytes, send_error
from router.kv_events import KVEventFollower
from router.lora_admin import LORA_PATHS, LoraAdmin
from router.messages_stream import anthropic_errors
from router.metrics import RouterMetrics
from router.own_routes import OWN_PATHS, answer_models, answer_own, reset_prefix_cache
from router.pd import PDOrchestrator
from router.pd_config import PDConfig, PDMetrics
from router.policies import make_policy
from router.policies.cache_aware import CacheAware
from router.pool import Pool, Replicas
from router.prompt_keys import PromptKeyer, make_keyer
from router.proxy_route import FORWARD_ROOT_PATHS, MESSAGES_PATH, proxy, refuse
from router.relay import ProxyCall
from router.replica import HealthPolicy, Replica
from router.response_affinity import ResponseAffinity
from router.retry import RetryPolicy
from router.upstream import UpstreamClient
from server.metrics_exposition import content_encoding
from server.middleware import request_id_of, route_path
from server.tracing import open_tracing

log = logging.getLogger("ferry.router")


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
        # OpenTelemetry spans of routed requests (--otlp-traces-endpoint; router/tracing.py)
        self.tracing = open_tracing(config.otlp_traces_endpoint, "ferry-router", "ferry.router")
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
        self.lora = LoraAdmin(self)  # adapter loads fanned out to every replica, and kept uniform
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
        return PDOrchestrator(
            pd, prefill, decode, keyer, PDMetrics(self.metrics.registry), config.block_size, self.tracing
        )

    @property
    def disaggregated(self) -> bool:
        """Generation requests go prefill -> decode while both pools have workers."""
        pools = self.replicas.pools
        return bool(len(pools["prefill"]) and len(pools["decode"]))

    async def generate(self, pool: Pool, call: ProxyCall, send: Send) -> None:
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
        if self.tracing is not None:  # the last spans leave (bounded: a collector may be down)
            await asyncio.to_thread(self.tracing.shutdown)

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
            wrong_key = "missing or wrong API key (Authorization: Bearer …)"
            if relayed:  # a span, with tracing, says why it went no further
                await refuse(self, scope, send, request_id, 401, wrong_key, id_header)
            else:
                await send_error(send, 401, wrong_key, id_header)
            return
        allowed = _own_methods(path)
        if allowed is not None and method not in allowed:
            headers = [*id_header, (b"allow", ", ".join(allowed).encode())]
            await send_error(send, 405, "Method Not Allowed", headers, "method_not_allowed")
        elif models:
            await answer_models(self, scope, send, unquote(path[len("/v1/models/") :]) or None)
        elif path in LORA_PATHS and method == "POST":
            await self.lora.handle(scope, receive, send, request_id)
        elif relayed:
            await proxy(self, scope, receive, send, request_id)
        elif path == "/reset_prefix_cache":
            await reset_prefix_cache(self, scope, send)
        elif path in OWN_PATHS:
            await answer_own(self, path, send)
        elif path == "/metrics":
            accept = header(scope, b"accept")
            body, content_type = self.metrics.exposition(accept.decode("latin-1") if accept else None)
            encoding = header(scope, b"accept-encoding")
            body, coding = content_encoding(body, encoding.decode("latin-1") if encoding else None)
            headers = [(name.encode(), value.encode()) for name, value in coding]
            await send_bytes(send, 200, body, headers, content_type=content_type.encode())
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


def _own_methods(path: str) -> tuple[str, ...] | None:
    """The methods a replica takes on a route the router answers itself (others: its 405);
    None for the routes relayed or sorted by method further on (``/v1/*``, ``/admin/*``)."""
    if path == "/reset_prefix_cache":
        return ("POST",)
    if path == "/ping":  # SageMaker's health check: GET or POST, as vLLM's
        return ("GET", "HEAD", "POST")
    if path in OWN_PATHS or path == "/metrics":
        return ("GET", "HEAD")
    return None


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
