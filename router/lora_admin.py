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
only to replicas that list it (``pool.serving``). An unload that a replica missed (it did not
answer, or answered 5xx) is kept on it (``Replica.lora_unloads``) and sent again the same way; no
request for that adapter goes there until it is gone. Operations on one adapter name, a client's
and the restores', run one at a time (``_serial``), so each replica ends as the last client
operation left it; a restore's load refused because the replica holds the adapter from the same
path by then (another router restored it first) is done, not failed. Nothing here is persisted: a
restarted router, or another router in front of the same replicas, learns the adapters the
replicas list (``router/lora_learn.py``: adoption, which owes an adopted adapter to the replicas
lacking it (``owe``), another party's loads and unloads, conflicting paths); a restore's load of an
adopted adapter reads a replica that listed it first (``_witness``), so one another router unloaded
meanwhile is not loaded back. This module must never import torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Iterable
from typing import TYPE_CHECKING, Any

from engine.keyed_locks import KeyedLocks
from router.health import model_list
from router.http import (
    BodyTooLarge,
    ClientGone,
    Receive,
    Scope,
    Send,
    error_body,
    error_code,
    read_body,
    send_bytes,
    send_json,
)
from router.lora_learn import LoraLearner
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
        self.adapters: dict[str, str] = {}  # name -> lora_path, loaded through the router or adopted
        self._pending: set[Replica] = set()
        self._retry: dict[Replica, tuple[float, float]] = {}  # replica -> (next attempt, delay)
        self._failures = app.metrics.lora_failures
        self._locks = KeyedLocks()  # adapter name -> its turn
        self._ops = 0  # client operations done: a restore re-reads a list read before one
        app.replicas.on_added.append(self._pending.add)
        app.replicas.on_removed.append(self._left)
        app.replicas.on_cache_lost.append(self._cache_lost)
        app.health.before_ready.append(self.restore)
        self.learn = LoraLearner(self)
        app.health.on_models.append(self.learn.observe)

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
            await _error(send, 400, "request body is not valid JSON", None, id_header, "invalid_json")
            return
        problem = _problem(body, load)
        if problem is not None:
            message, param, code = problem
            await _error(send, 400, message, param, id_header, code)
            return
        async with self._serial(body["lora_name"]):
            answers, replicas = await self._fan_out(scope, raw, body, load, request_id)
        if not replicas:
            await _error(send, 503, "no replicas to change LoRA adapters on", None, id_header)
            return
        statuses = {r.url: status for r, (status, _) in zip(replicas, answers, strict=True)}
        failed = next(((s, t) for s, t in answers if s != 200), None)
        if failed is None:
            await send_json(send, 200, {"message": answers[0][1], "replicas": statuses}, id_header)
            return
        status, text = failed
        await send_json(send, status, {**_error_of(status, text), "replicas": statuses}, id_header)

    async def _fan_out(
        self, scope: Scope, raw: bytes, body: dict, load: bool, request_id: str
    ) -> tuple[list[tuple[int, str]], list[Replica]]:
        """Send one load or unload to every replica (holding the name's turn) and note its outcome."""
        replicas = list(self.app.replicas)
        if not replicas:
            return [], []
        headers = [
            *self.app.auth_headers(scope),
            (b"content-type", b"application/json"),
            (b"x-request-id", request_id.encode()),
        ]
        timeout = self.app.config.request_timeout
        name = body["lora_name"]
        path = body["lora_path"] if load else None
        answers = await asyncio.gather(
            *(self._send(r, scope["path"], raw, headers, timeout, name, path) for r in replicas)
        )
        op = "load" if load else "unload"
        for r, (status, text) in zip(replicas, answers, strict=True):
            if status != 200:
                self._failures.labels(op).inc()
                log.warning("LoRA %s of %r on replica %s: %d %s", op, name, r.url, status, text[:200])
        ok = [r for r, (status, _) in zip(replicas, answers, strict=True) if status == 200]
        if load and ok:
            self.learn.loaded(name, body["lora_path"])
            # Those that failed while others loaded it get it at their next good probe.
            self._pending.update(r for r in replicas if r not in ok)
            for r in replicas:
                r.lora_unloads.discard(name)
        elif not load:
            self.learn.unloaded_here(name)
            for r, (status, _) in zip(replicas, answers, strict=True):
                if status >= 500:  # it did not say whether it holds the adapter: ask again later
                    r.lora_unloads.add(name)
                    self._pending.add(r)
                else:
                    r.lora_unloads.discard(name)
        for r in ok:
            r.models_read_at = float("-inf")  # its /v1/models changed: read again at the next probe
        if ok:
            log.info("LoRA adapter %r %sed on %d of %d replicas", name, op, len(ok), len(replicas))
        self._ops += 1
        return answers, replicas

    @contextlib.asynccontextmanager
    async def _serial(self, name: str) -> AsyncIterator[None]:
        """One operation on adapter ``name`` at a time (a client's, or a restore onto one replica)."""
        if self._locks.busy(name):
            log.info("LoRA adapter %r: waiting for the change to it in progress", name)
        async with self._locks.hold(name):
            yield

    async def _send(
        self,
        replica: Replica,
        path: str,
        body: bytes,
        headers: list[tuple[bytes, bytes]],
        timeout: float,
        name: str,
        lora_path: str | None,
    ) -> tuple[int, str]:
        """One replica's (status, body text) to a load of ``name`` from ``lora_path`` (None: an
        unload); 502 when it did not answer in ``timeout``."""
        with self.learn.sending(replica):
            try:
                response = await asyncio.wait_for(
                    self.app.upstream.request("POST", replica.url, path, headers, body), timeout
                )
                try:
                    content = await asyncio.wait_for(response.aread(), timeout)
                finally:
                    await response.aclose()
            except (UpstreamError, asyncio.TimeoutError) as e:
                status, text = 502, f"replica {replica.url} did not answer: {e or type(e).__name__}"
            else:
                status, text = response.status_code, content.decode("utf-8", "replace")
        self.learn.sent(replica, name, lora_path, status)
        return status, text

    # ---- keeping the pool uniform -------------------------------------------------------------
    def pending(self, replica: Replica) -> dict[str, Any]:
        """The LoRA work the router still owes ``replica`` (``GET /admin/replicas`` shows it, so an
        operator sees why it serves no adapter yet): ``restore``, the adapters it remembers (loaded
        through it or adopted) that its last-read ``/v1/models`` lacks while a restore is due;
        ``unloads``, the unloads it missed; ``next_try_in_s``, when that work is tried next (seconds
        from now: its next probe, or later while a failed try backs off; null when nothing is owed);
        ``mismatched``, the adapters it lists under another path than the router's (not routed there)."""
        due = replica in self._pending
        owed = (n for n in self.adapters if n not in replica.models and self.learn.owes(replica, n))
        restore = sorted(owed) if due else []
        unloads = sorted(replica.lora_unloads)
        next_try = None
        if restore or unloads:
            now = self.app.clock()
            at = self._retry[replica][0] if replica in self._retry else now
            next_try = round(max(0.0, at - now, replica.next_probe_at - now), 1)
        return {
            "restore": restore,
            "unloads": unloads,
            "next_try_in_s": next_try,
            "mismatched": sorted(replica.lora_mismatch),
        }

    def owe(self, replicas: Iterable[Replica]) -> None:
        """Bring ``replicas`` to what the router remembers at their next good probe (an adapter it
        adopted, an unload it took back: router/lora_learn.py), with the restore's backoff."""
        self._pending.update(replicas)

    def _left(self, replica: Replica) -> None:
        self._pending.discard(replica)
        self._retry.pop(replica, None)
        self.learn.restarted(replica)

    def _cache_lost(self, replica: Replica, restarted: bool) -> None:
        """A restart (or, from a server naming no instance, a return after being ejected) drops the
        adapters loaded at run time: reload them, and route none of them there until then."""
        if not restarted and replica.instance_id is not None:
            return  # a prefix-cache reset: its adapters stay
        self._pending.add(replica)
        self._retry.pop(replica, None)
        replica.models = [m for m in replica.models if m not in self.adapters]
        self.learn.restarted(replica)  # what it lists now is a fresh start, not a change

    async def restore(self, replica: Replica) -> None:
        """Load the remembered adapters a pending replica's ``/v1/models`` lacks and unload those it
        missed the unload of (the prober awaits this after a good ``/health``, before marking the
        replica healthy). Never raises."""
        if replica not in self._pending:
            return
        now = self.app.clock()
        at, delay = self._retry.get(replica, (now, RETRY_FIRST_S))
        if at > now:
            return
        self._pending.discard(replica)  # taken: a client operation failing here meanwhile adds it back
        names = self._owed(replica)
        if not names:
            self._retry.pop(replica, None)
            return
        timeout = min(self.app.config.request_timeout, RESTORE_TIMEOUT_S)
        ops = self._ops
        listed = await self._read(replica, timeout)
        if listed is None:
            self._pending.add(replica)
            self._retry[replica] = (now + delay, min(delay * 2, RETRY_MAX_S))
            return
        names = self._owed(replica)  # as learned from that list too
        roots = {m["id"]: m.get("root") for m in listed}
        done = await asyncio.gather(*(self._converge(replica, n, roots, ops, timeout, delay) for n in names))
        replica.models_read_at = float("-inf")  # the prober reads its list right after this
        if all(done):
            self._retry.pop(replica, None)
        else:
            self._pending.add(replica)
            self._retry[replica] = (now + delay, min(delay * 2, RETRY_MAX_S))

    def _owed(self, replica: Replica) -> list[str]:
        """The adapters a restore of ``replica`` loads or unloads."""
        return sorted({*(n for n in self.adapters if self.learn.owes(replica, n)), *replica.lora_unloads})

    async def _converge(
        self, replica: Replica, name: str, roots: dict[str, Any], ops: int, timeout: float, delay: float
    ) -> bool:
        """Make ``replica`` hold adapter ``name`` as the router was last told, in the name's turn;
        ``roots`` is its ``/v1/models`` as read when ``self._ops`` was ``ops``. False: try again."""
        async with self._serial(name):
            if self._ops != ops:  # a client's load or unload ran since that read: read again
                listed = await self._read(replica, timeout)
                if listed is None:
                    return False
                roots = {m["id"]: m.get("root") for m in listed}
            path = self.adapters.get(name) if self.learn.owes(replica, name) else None
            if path is not None and roots.get(name) != path and name in self.learn.adopted:
                await self._witness(replica, name, path, timeout)
                path = self.adapters.get(name) if self.learn.owes(replica, name) else None
            if path is not None:
                if roots.get(name) == path:
                    return True
                op, sent = "loaded onto", _load_body(name, path, name in roots)
                status, text = await self._send(
                    replica, LOAD_PATH, sent, self._headers(), timeout, name, path
                )
                if status == 400 and await self._holds(replica, name, path, timeout):
                    return True  # "already loaded": another router restored it first (lora_learn.py)
            elif name not in replica.lora_unloads:
                return True
            elif name not in roots:
                replica.lora_unloads.discard(name)
                return True
            else:
                op, sent = "unloaded from", json.dumps({"lora_name": name}).encode()
                status, text = await self._send(
                    replica, UNLOAD_PATH, sent, self._headers(), timeout, name, None
                )
                if status < 500:  # gone, or the replica's own answer why not: nothing to retry
                    replica.lora_unloads.discard(name)
        if status == 200:
            log.info("LoRA adapter %r %s replica %s, which missed it", name, op, replica.url)
            if path is not None:
                self.learn.place(replica, name)
            return True
        self._failures.labels("restore").inc()
        log.warning(
            "LoRA adapter %r could not be %s replica %s (retrying in %.0fs): %d %s",
            name,
            op,
            replica.url,
            delay,
            status,
            text[:200],
        )
        return name not in self.adapters and name not in replica.lora_unloads

    async def _witness(self, replica: Replica, name: str, path: str, timeout: float) -> None:
        """Before loading adopted adapter ``name`` onto ``replica``, read a replica that listed it: if
        another router unloaded it meanwhile, that read shows it (router/lora_learn.py) and it is not
        loaded back."""
        for other in list(self.app.replicas):
            seen = other.lora_seen
            if other is not replica and seen is not None and seen.get(name) == path:
                if await self._read(other, timeout) is not None:
                    return

    async def _holds(self, replica: Replica, name: str, path: str, timeout: float) -> bool:
        """Whether ``replica`` lists adapter ``name`` from ``path`` now."""
        listed = await self._read(replica, timeout) or []
        return any(m["id"] == name and m.get("root") == path for m in listed)

    async def _read(self, replica: Replica, timeout: float) -> list[dict] | None:
        """``replica``'s ``/v1/models`` entries, learned from (``LoraLearner.observe``); None: no answer."""
        token = replica.lora_changes
        listed = await model_list(self.app.client, replica.url, self.app.replica_auth, timeout)
        if listed:
            self.learn.observe(replica, listed, token)
        return listed

    def _headers(self) -> list[tuple[bytes, bytes]]:
        return [*self.app.replica_auth, (b"content-type", b"application/json")]


def _load_body(name: str, path: str, replace: bool) -> bytes:
    return json.dumps({"lora_name": name, "lora_path": path, "load_inplace": replace}).encode()


def _problem(body: Any, load: bool) -> tuple[str, str | None, str] | None:
    """Why the replicas could not act on this request body (message, param, code), or None."""
    if not isinstance(body, dict):
        return "request body must be a JSON object", None, "invalid_value"
    for field in ("lora_name", "lora_path") if load else ("lora_name",):
        value = body.get(field)
        if value is None:
            return f"{field} is required", field, "missing_required_parameter"
        if not isinstance(value, str) or not value:
            return f"{field} must be a non-empty string", field, "invalid_value"
    if load and not isinstance(body.get("load_inplace", False), bool):
        return "load_inplace must be a boolean", "load_inplace", "invalid_value"
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
    send: Send,
    status: int,
    message: str,
    param: str | None,
    headers: list[tuple[bytes, bytes]],
    code: str | None = None,
) -> None:
    body = error_body(message, error_type(status), code or error_code(status), param)
    await send_bytes(send, status, body, headers)
