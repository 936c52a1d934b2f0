"""Active health checking: probe each replica's ``GET /health`` on its own schedule.

Healthy replicas are probed every ``probe_interval``; starting and ejected ones back off
exponentially (``Replica.on_probe_fail``), so a dead replica costs little and a restarted one is
readmitted by its first good probe. Good probes also read its ``/v1/models`` (at most every
``MODELS_REFRESH_S``): the names and LoRA adapters it serves, which route requests by ``model``,
and the model cards the router's ``/v1/models`` falls back on when a replica does not answer it
in time. The read comes before the probe marks the replica healthy, so a replica that joins (at
start-up, from discovery or the admin API) takes requests only once the router knows what it
serves (one whose ``/v1/models`` gives no answer in time is routable without it). A removed
replica whose requests are still in flight (``Replicas.retiring``) is probed too, until they
end: a removed replica that hangs is ejected and its streams cut, as any other.
A ferry replica's ``/health`` body names its role: one that differs from the role the router was
given for it is logged, and a replica reporting ``prefill`` takes no whole requests (``Replica.misrole``).
A ferry replica's body also names its engine's ``instance_id`` (new at each start) and
``prefix_cache_resets`` (how often it emptied its prefix cache: sleep, new weights, a reset): when
either changes, what the router believed it held is forgotten (``Replicas.cache_lost``: the
cache_aware policy's prefix index; with KV events followed, ``router/kv_events.py`` decides what
a restart drops, as the replica's events may have shown the new instance first). A replica that
names neither (another server) is taken as restarted when it comes back after being ejected.
A ferry replica started with ``--lora-resolver-dir`` says ``"lora_resolver": true``: requests naming
a model no replica lists go to such replicas (``router/pool.py``), and after one answers such a
request the relay lists the name there at once (``Replica.lora_resolved``) and its ``/v1/models`` is
read at its next probe (``Replica.models_read_at`` reset by the relay), so the adapter it loaded is
routed to from the next request on, and its card and weights digest learnt.
Between a good ``/health`` and marking the replica healthy it awaits ``before_ready`` hooks (a new or
restarted replica gets the LoRA adapters loaded through the router: ``router/lora_admin.py``); each
``/v1/models`` read goes to ``on_models`` hooks (the router learns adapters: ``router/lora_learn.py``).
The prober only calls the state machine in ``router/replica.py``; it decides nothing itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable

from router.metrics import RouterMetrics
from router.pool import Replicas
from router.replica import Health, Replica
from router.upstream import UpstreamClient, UpstreamError, get_json

log = logging.getLogger("ferry.router")
TICK = 0.05  # scheduler resolution; probes run on each replica's own schedule
# How often a healthy replica's /v1/models is read again: LoRA adapters come and go at run time.
MODELS_REFRESH_S = 5.0
RESTARTED = "restarted"


class HealthChecker:
    def __init__(
        self,
        replicas: Replicas,
        client: UpstreamClient,
        metrics: RouterMetrics,
        timeout: float,
        clock: Callable[[], float] = time.monotonic,
        auth: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        self.replicas = replicas
        self.auth = auth or []  # the replicas' Authorization header, for /v1/models
        self.client = client
        self.metrics = metrics
        self.timeout = timeout
        self.clock = clock
        self._probing: set[Replica] = set()
        self._task: asyncio.Task | None = None
        self._children: set[asyncio.Task] = set()
        # Awaited after a good /health, before the replica is marked healthy: what readies a new or
        # restarted replica (its LoRA adapters, router/lora_admin.py). Hooks never raise.
        self.before_ready: list[Callable[[Replica], Awaitable[None]]] = []
        # Called with each /v1/models read of a replica and its ``lora_changes`` when the read began
        # (the router learns LoRA adapters from them: router/lora_learn.py).
        self.on_models: list[Callable[[Replica, list[dict], int], None]] = []

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="ferry-router-health")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._children) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    async def probe_all(self, timeout: float | None = None) -> None:
        """Probe every replica now (at start, so a router over running replicas is ready at once)."""
        await asyncio.gather(*(self.probe(r, timeout) for r in list(self.replicas)), return_exceptions=True)

    async def _run(self) -> None:
        while True:
            now = self.clock()
            for r in [*self.replicas, *self.replicas.retiring()]:
                if r.next_probe_at <= now and r not in self._probing:
                    task = asyncio.create_task(self.probe(r))
                    self._children.add(task)
                    task.add_done_callback(self._children.discard)
            await asyncio.sleep(TICK)

    async def probe(self, replica: Replica, timeout: float | None = None) -> bool:
        if replica in self._probing:
            return replica.routable(self.clock())
        self._probing.add(replica)
        known = (replica.instance_id, replica.prefix_cache_resets)
        try:
            ok = await self._check(replica, timeout or self.timeout)
            before = replica.health
            if ok and not replica.removed:
                lost = self._cache_lost(replica, known, before)
                if lost is not None:
                    log.warning("replica %s %s: forgetting the KV blocks it held", replica.url, lost)
                    self.replicas.cache_lost(replica, restarted=lost == RESTARTED)
                for hook in self.before_ready:  # still probing: no second probe marks it healthy first
                    await hook(replica)
                # Read before it is marked healthy: a replica that joins (or comes back) is routable
                # only once the router knows the models and LoRA adapters it serves, else a request
                # for an adapter only it serves could go to one without it (a 404).
                if not replica.models or self.clock() - replica.models_read_at >= MODELS_REFRESH_S:
                    await self._read_models(replica, timeout or self.timeout)
        finally:
            self._probing.discard(replica)
        if ok:
            replica.on_probe_ok(self.clock())
        else:
            replica.on_probe_fail(self.clock())
        if replica.health is not before:
            removed = " (removed, requests in flight)" if replica.removed else ""
            log.warning("replica %s%s: %s -> %s", replica.url, removed, before.value, replica.health.value)
        if self.replicas.find(replica.url) is replica:  # not removed meanwhile
            self.metrics.healthy.labels(replica.url).set(1 if replica.routable(self.clock()) else 0)
        return ok

    @staticmethod
    def _cache_lost(replica: Replica, known: tuple[str | None, int | None], before: Health) -> str | None:
        """How a good probe shows the replica's KV cache was emptied since the last one (None: it
        was not): another instance, more prefix-cache resets, or, for a replica that names no
        instance, a return from being ejected (perhaps a restart)."""
        instance, resets = known
        if replica.instance_id is None or instance is None:
            return "is back after being ejected" if before is Health.EJECTED else None
        if replica.instance_id != instance:
            return RESTARTED
        if resets is not None and replica.prefix_cache_resets != resets:
            return "emptied its prefix cache"
        return None

    async def _check(self, replica: Replica, timeout: float) -> bool:
        try:
            response = await asyncio.wait_for(
                self.client.request("GET", replica.url, "/health", [], b""), timeout
            )
            content = await asyncio.wait_for(response.aread(), timeout)
            await response.aclose()
        except (UpstreamError, asyncio.TimeoutError):
            return False
        if response.status_code != 200:
            return False
        try:  # a ferry replica says whether its engine sleeps; other servers' bodies say nothing
            body = json.loads(content)
        except ValueError:
            body = None
        body = body if isinstance(body, dict) else {}
        replica.sleeping = body.get("sleeping") is True
        replica.paused = body.get("paused") is True
        replica.lora_resolver = body.get("lora_resolver") is True
        instance, resets = body.get("instance_id"), body.get("prefix_cache_resets")
        replica.instance_id = instance if isinstance(instance, str) and instance else None
        replica.prefix_cache_resets = (
            resets if isinstance(resets, int) and not isinstance(resets, bool) else None
        )
        role = body.get("role")
        if isinstance(role, str) and role != replica.reported_role:
            self._role_reported(replica, role)
        return True

    @staticmethod
    def _role_reported(replica: Replica, role: str) -> None:
        """The replica names its role (``ferry serve --role``): trusted over the one it was added
        with where they disagree in a way that breaks requests (module docstring)."""
        replica.reported_role = role
        replica.misrole = role == "prefill" and replica.role != "prefill"
        if role == replica.role:
            return
        if replica.misrole:
            log.error(
                "replica %s was added as a %s replica (%s) but reports role 'prefill': a prefill "
                "worker answers every request with one token, so it gets no requests here; add it "
                'as a prefill worker (--prefill URL, or POST /admin/replicas with "role": "prefill")',
                replica.url,
                replica.role,
                replica.source,
            )
        else:
            log.warning(
                "replica %s was added as a %s replica (%s) but reports role %r: it is used as %s",
                replica.url,
                replica.role,
                replica.source,
                role,
                replica.role,
            )

    async def _read_models(self, replica: Replica, timeout: float) -> None:
        """The replica's served names, LoRA adapters and model cards (kept as they were if it does
        not answer)."""
        token = replica.lora_changes
        began = self.clock()
        data = await model_list(self.client, replica.url, self.auth, timeout)
        if data:
            for hook in self.on_models:
                hook(replica, data, token)
            replica.model_cards = data
            models = [m["id"] for m in data]
            # An adapter it resolved after this read began may be missing from it: kept, and the
            # list read again at the next probe. One resolved before is listed, or gone (unloaded).
            kept = {n: at for n, at in replica.lora_resolved.items() if n not in models and at >= began}
            replica.lora_resolved = kept
            replica.models = models + list(kept)
            replica.lora_weights = {
                m["id"]: m["lora_weights_id"] for m in data if isinstance(m.get("lora_weights_id"), str)
            }
            replica.models_read_at = float("-inf") if kept else self.clock()


async def model_list(
    client: UpstreamClient, url: str, headers: list[tuple[bytes, bytes]], timeout: float
) -> list[dict] | None:
    """A replica's ``/v1/models`` entries; None when it gave no usable answer in time."""
    try:
        body = await asyncio.wait_for(get_json(client, url, "/v1/models", headers), timeout)
    except (UpstreamError, asyncio.TimeoutError, ValueError):
        return None
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        return None
    return [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
