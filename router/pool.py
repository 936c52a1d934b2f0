"""Replica pools: the replicas of one role, and the set of pools a router serves.

A ``Pool`` keeps replicas in insertion order (so round_robin is exact and tests can predict
assignments) and answers "which replicas may take a request now". ``Replicas`` holds one pool per
role (``mixed`` today; ``prefill`` and ``decode`` for PD orchestration) and is what the admin API,
discovery and the health prober change. A replica removed while requests to it are in flight is
*retiring* until they end: no pool has it, but the prober still watches it, so that if it stops
answering its streams are cut and resumed elsewhere as an ejected replica's are. Everything here
runs on the router's event loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

from kvcache.keys import lora_extra
from router.discovery import ROLES, check_replica_url, normalize_url
from router.replica import HealthPolicy, Replica


class Pool:
    def __init__(self, role: str) -> None:
        self.role = role
        self._replicas: dict[str, Replica] = {}
        # Single flight of a name no replica lists: model -> (the URL of the resolving replica the
        # first request for it was sent to, how many requests for it were sent there and have no
        # answer yet), until an answer settles it (the name is then listed there, or the entry
        # goes: router/relay.py). Requests for the name meanwhile follow it, so one replica loads
        # the adapter, not every resolving replica the policy would spread them over.
        self.resolving: dict[str, tuple[str, int]] = {}

    def __len__(self) -> int:
        return len(self._replicas)

    def __iter__(self) -> Iterator[Replica]:
        return iter(list(self._replicas.values()))

    def __contains__(self, url: str) -> bool:
        return url in self._replicas

    def get(self, url: str) -> Replica | None:
        return self._replicas.get(url)

    def add(self, replica: Replica) -> None:
        self._replicas[replica.url] = replica

    def pop(self, url: str) -> Replica | None:
        return self._replicas.pop(url, None)

    def candidates(self, now: float, exclude: set[str] | frozenset[str] = frozenset()) -> list[Replica]:
        return [r for r in self._replicas.values() if r.url not in exclude and r.routable(now)]

    def counts(self, now: float) -> dict[str, int]:
        return counts(self._replicas.values(), now)


def counts(replicas: Iterable[Replica], now: float) -> dict[str, int]:
    total = routable = 0
    for r in replicas:
        total += 1
        routable += r.routable(now)
    return {"total": total, "routable": routable}


def serving(model: object, candidates: list[Replica], pool: Iterable[Replica] = ()) -> list[Replica]:
    """Those of ``candidates`` that list ``model`` (a LoRA adapter loaded on some replicas only),
    when any does; else those that resolve LoRA adapters from a directory (``Replica.lora_resolver``:
    a ferry replica's ``--lora-resolver-dir`` loads the name if it holds it), when any does; none
    when only replicas of ``pool`` that cannot take it now list it (another model's replica would
    answer a 404 saying the model does not exist: the router's 503 says to retry); else all of them
    (a name none lists, such as an alias of the base model, is the replica's to answer, with a 404
    if it serves no such model). A replica that still holds an
    adapter unloaded through the router (``Replica.lora_unloads``), or that lists it under another
    path than the router knows it by (``Replica.lora_mismatch``), is never one of them for it."""
    if not isinstance(model, str):
        return candidates
    candidates = [r for r in candidates if model not in r.lora_unloads and model not in r.lora_mismatch]
    pool = [r for r in pool if model not in r.lora_unloads and model not in r.lora_mismatch]
    listing = [r for r in candidates if model in r.models]
    if listing:
        return listing
    resolving = [r for r in candidates if r.lora_resolver]
    if resolving or any(model in r.models for r in pool):
        return resolving
    return candidates


def awake(candidates: list[Replica]) -> list[Replica]:
    """Those of ``candidates`` whose engine is neither asleep (sleep mode) nor paused (vLLM's
    /pause), when any is; else all of them (a sleeping or paused replica holds a request until it
    wakes up or resumes, better than no answer)."""
    up = [r for r in candidates if not r.sleeping and not r.paused]
    return up if up and len(up) < len(candidates) else candidates


class Replicas:
    """All pools of one router, plus hooks that fire when a replica is added or removed."""

    def __init__(
        self, health_policy: HealthPolicy | None = None, clock: Callable[[], float] = time.monotonic
    ):
        self.pools: dict[str, Pool] = {role: Pool(role) for role in ROLES}
        self.health_policy = health_policy or HealthPolicy()
        self.clock = clock
        self.on_added: list[Callable[[Replica], None]] = []
        self.on_removed: list[Callable[[Replica], None]] = []
        # A replica's KV cache was emptied while it stayed in the router (restart, prefix cache
        # reset); the flag says whether it restarted (its /health names a new instance).
        self.on_cache_lost: list[Callable[[Replica, bool], None]] = []
        self._retiring: list[Replica] = []  # removed, with requests still in flight

    def __iter__(self) -> Iterator[Replica]:
        for pool in self.pools.values():
            yield from pool

    def lora_extra(self, model: object) -> bytes:
        """The block-hash salt of requests naming ``model``: a LoRA adapter's as a replica lists it
        (``kvcache.keys.lora_extra``), else none."""
        if isinstance(model, str):
            for r in self:
                weights_id = r.lora_weights.get(model)
                if weights_id is not None:
                    return lora_extra(model, weights_id)
        return b""

    def find(self, url: str) -> Replica | None:
        url = normalize_url(url)
        for pool in self.pools.values():
            r = pool.get(url)
            if r is not None:
                return r
        return None

    def add(self, url: str, role: str = "mixed", source: str = "static") -> tuple[Replica, bool]:
        """Add a replica (or return the existing one). Returns (replica, created)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        url = normalize_url(url)
        check_replica_url(url)
        existing = self.find(url)
        if existing is not None:
            if existing.role != role:
                raise ValueError(f"{url} is already registered with role {existing.role!r}")
            existing.draining = False  # re-adding a drained replica puts it back in service
            return existing, False
        replica = Replica(url, role, source=source, policy=self.health_policy)
        replica.next_probe_at = self.clock()  # probe at once
        self.pools[role].add(replica)
        for hook in self.on_added:
            hook(replica)
        return replica, True

    def remove(self, url: str) -> Replica | None:
        url = normalize_url(url)
        for pool in self.pools.values():
            r = pool.pop(url)
            if r is not None:
                r.removed = True
                if r.inflight:
                    self._retiring.append(r)
                for hook in self.on_removed:
                    hook(r)
                return r
        return None

    def cache_lost(self, replica: Replica, restarted: bool = False) -> None:
        """``replica`` holds no KV blocks now (it ``restarted`` as ``replica.instance_id``, or
        dropped its prefix cache)."""
        for hook in self.on_cache_lost:
            hook(replica, restarted)

    def retiring(self) -> list[Replica]:
        """Removed replicas whose requests are still in flight (the prober watches them until
        those end)."""
        if self._retiring:
            self._retiring = [r for r in self._retiring if r.inflight]
        return self._retiring

    def drain(self, url: str) -> Replica | None:
        r = self.find(url)
        if r is not None:
            r.draining = True
        return r
