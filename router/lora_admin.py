"""LoRA adapters loaded and unloaded through the router, on every replica at once.

vLLM's runtime routes ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` and
``POST /v1/unload_lora_adapter`` ``{"lora_name"}`` change one server's adapters. Relayed like any
``/v1`` request they would reach one replica of N; here they reach every replica of every pool
(prefill and decode too), concurrently, with the replicas' key (``RouterApp.auth_headers``). The
answer is 200 when every replica said 200 (the replica's message plus each replica's status under
``replicas``), else the first failing replica's status with its OpenAI-format error (502 for one
that did not answer) and every replica's status. The body is checked here first: a missing or
malformed ``lora_name`` / ``lora_path`` is the router's 400, sent to no replica.

The router remembers the adapters loaded through it (name -> path) and forgets unloaded ones, so
the pool stays uniform: a replica that joins later (admin, discovery), restarts (its ``/health``
names a new ``instance_id``) or failed the fan-out is *pending*; at its next good probe, before the
prober marks it healthy (``HealthChecker.before_ready``), the adapters its ``/v1/models`` lacks are
loaded onto it. A failure is logged, counted (``ferry:router_lora_failures_total{op}``) and retried
at later probes with backoff; the replica is routable meanwhile, since requests for an adapter go
only to replicas that list it (``pool.serving``). Nothing here is persisted: a restarted router
knows only what is loaded through it from then on. This module must never import torch.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, Any

from router.health import model_list
from router.http import (
    BodyTooLarge,
    ClientGone,
    Receive,
    Scope,
    Send,
    error_body,
    read_body,
    send_bytes,
    send_json,
)
from router.replica import Replica
from router.upstream import UpstreamError
from server.error_types import error_type

if TYPE_CHECKING:
    from router.app import RouterApp

log = logging.getLogger("ferry.router")

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
LORA_PATHS = frozenset({LOAD_PATH, UNLOAD_PATH})
# How long a probe waits for a pending replica's loads: it is not routable meanwhile (a new one),
# or not probed (a restarted one), so far shorter than --request-timeout.
RESTORE_TIMEOUT_S = 60.0
RETRY_FIRST_S, RETRY_MAX_S = 1.0, 60.0  # backoff between restore attempts on one replica


class LoraAdmin:
    """The adapters loaded through one router and the replicas that may still lack them. Runs on the
    router's event loop; hooks into ``Replicas`` (added, removed, restarted) and the prober."""

    def __init__(self, app: RouterApp) -> None:
        self.app = app
        self.adapters: dict[str, str] = {}  # name -> lora_path, as loaded through the router
        self._pending: set[Replica] = set()
        self._retry: dict[Replica, tuple[float, float]] = {}  # replica -> (next attempt, delay)
        self._failures = app.metrics.lora_failures
        app.replicas.on_added.append(self._pending.add)
        app.replicas.on_removed.append(self._left)
        app.replicas.on_cache_lost.append(self._cache_lost)
        app.health.before_ready.append(self.restore)

    # ---- the routes ---------------------------------------------------------------------------
    async def handle(self, scope: Scope, receive: Receive, send: Send, request_id: str) -> None:
        id_header = [(b"x-request-id", request_id.encode())]
        try:
            raw = await read_body(receive, self.app.config.max_request_bytes)
        except BodyTooLarge:
            limit = self.app.config.max_request_bytes
            await _error(send, 413, f"request body exceeds {limit} bytes", None, id_header)
            return
        except ClientGone:
            return
        load = scope["path"] == LOAD_PATH
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            body = None
        problem = _problem(body, load)
        if problem is not None:
            await _error(send, 400, *problem, id_header)
            return
        replicas = list(self.app.replicas)
        if not replicas:
            await _error(send, 503, "no replicas to change LoRA adapters on", None, id_header)
            return
        headers = [
            *self.app.auth_headers(scope),
            (b"content-type", b"application/json"),
            (b"x-request-id", request_id.encode()),
        ]
        timeout = self.app.config.request_timeout
        answers = await asyncio.gather(
            *(self._send(r, scope["path"], raw, headers, timeout) for r in replicas)
        )
        statuses = {r.url: status for r, (status, _) in zip(replicas, answers, strict=True)}
        name = body["lora_name"]
        op = "load" if load else "unload"
        for r, (status, text) in zip(replicas, answers, strict=True):
            if status != 200:
                self._failures.labels(op).inc()
                log.warning("LoRA %s of %r on replica %s: %d %s", op, name, r.url, status, text[:200])
        ok = [r for r, (status, _) in zip(replicas, answers, strict=True) if status == 200]
        if load and ok:
            self.adapters[name] = body["lora_path"]
            # Those that failed while others loaded it get it at their next good probe.
            self._pending.update(r for r in replicas if r not in ok)
        elif not load:
            self.adapters.pop(name, None)
        for r in ok:
            r.models_read_at = float("-inf")  # its /v1/models changed: read again at the next probe
        if ok:
            log.info("LoRA adapter %r %sed on %d of %d replicas", name, op, len(ok), len(replicas))
        failed = next(((s, t) for s, t in answers if s != 200), None)
        if failed is None:
            await send_json(send, 200, {"message": answers[0][1], "replicas": statuses}, id_header)
            return
        status, text = failed
        await send_json(send, status, {**_error_of(status, text), "replicas": statuses}, id_header)

    async def _send(
        self, replica: Replica, path: str, body: bytes, headers: list[tuple[bytes, bytes]], timeout: float
    ) -> tuple[int, str]:
        """One replica's (status, body text); 502 when it did not answer in ``timeout``."""
        try:
            response = await asyncio.wait_for(
                self.app.upstream.request("POST", replica.url, path, headers, body), timeout
            )
            try:
                content = await asyncio.wait_for(response.aread(), timeout)
            finally:
                await response.aclose()
        except (UpstreamError, asyncio.TimeoutError) as e:
            return 502, f"replica {replica.url} did not answer: {e or type(e).__name__}"
        return response.status_code, content.decode("utf-8", "replace")

    # ---- keeping the pool uniform -------------------------------------------------------------
    def _left(self, replica: Replica) -> None:
        self._pending.discard(replica)
        self._retry.pop(replica, None)

    def _cache_lost(self, replica: Replica, restarted: bool) -> None:
        """A restart (or, from a server naming no instance, a return after being ejected) drops the
        adapters loaded at run time: reload them, and route none of them there until then."""
        if not restarted and replica.instance_id is not None:
            return  # a prefix-cache reset: its adapters stay
        self._pending.add(replica)
        self._retry.pop(replica, None)
        replica.models = [m for m in replica.models if m not in self.adapters]

    async def restore(self, replica: Replica) -> None:
        """Load the remembered adapters a pending replica's ``/v1/models`` lacks (the prober awaits
        this after a good ``/health``, before marking the replica healthy). Never raises."""
        if replica not in self._pending:
            return
        if not self.adapters:
            self._pending.discard(replica)
            return
        now = self.app.clock()
        at, delay = self._retry.get(replica, (now, RETRY_FIRST_S))
        if at > now:
            return
        timeout = min(self.app.config.request_timeout, RESTORE_TIMEOUT_S)
        listed = await model_list(self.app.client, replica.url, self.app.replica_auth, timeout)
        if listed is None:
            self._retry[replica] = (now + delay, min(delay * 2, RETRY_MAX_S))
            return
        roots = {m["id"]: m.get("root") for m in listed}
        wanted = [(n, p) for n, p in self.adapters.items() if roots.get(n) != p]
        headers = [*self.app.replica_auth, (b"content-type", b"application/json")]
        answers = await asyncio.gather(
            *(
                self._send(replica, LOAD_PATH, _load_body(n, p, n in roots), headers, timeout)
                for n, p in wanted
            )
        )
        failed = 0
        for (name, path), (status, text) in zip(wanted, answers, strict=True):
            if status == 200:
                log.info(
                    "LoRA adapter %r (%s) loaded onto replica %s, which lacked it", name, path, replica.url
                )
            else:
                failed += 1
                self._failures.labels("restore").inc()
                log.warning(
                    "could not load LoRA adapter %r onto replica %s (retrying in %.0fs): %d %s",
                    name,
                    replica.url,
                    delay,
                    status,
                    text[:200],
                )
        if wanted:
            replica.models_read_at = float("-inf")  # the prober reads its list right after this
        if failed:
            self._retry[replica] = (now + delay, min(delay * 2, RETRY_MAX_S))
        else:
            self._pending.discard(replica)
            self._retry.pop(replica, None)


def _load_body(name: str, path: str, replace: bool) -> bytes:
    return json.dumps({"lora_name": name, "lora_path": path, "load_inplace": replace}).encode()


def _problem(body: Any, load: bool) -> tuple[str, str | None] | None:
    """Why the replicas could not act on this request body (message, param), or None."""
    if not isinstance(body, dict):
        return "request body must be a JSON object", None
    for field in ("lora_name", "lora_path") if load else ("lora_name",):
        value = body.get(field)
        if not isinstance(value, str) or not value:
            return f"{field} must be a non-empty string", field
    if load and not isinstance(body.get("load_inplace", False), bool):
        return "load_inplace must be a boolean", "load_inplace"
    return None


def _error_of(status: int, text: str) -> dict[str, Any]:
    """A replica's OpenAI error body as it sent it; else one built around what it said."""
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return {"error": body["error"]}
    return json.loads(error_body(text or f"a replica answered {status}", error_type(status), status))


async def _error(
    send: Send, status: int, message: str, param: str | None, headers: list[tuple[bytes, bytes]]
) -> None:
    await send_bytes(send, status, error_body(message, error_type(status), status, param), headers)
