"""The LoRA adapter names whose last word at this router was an unload (a client's through it, or
another party's it saw): ``LoraLearner`` (router/lora_learn.py) adopts none of them from a replica
that still lists it, since that replica missed the unload rather than a load.

A tombstone is needed only while some replica may still hold the adapter, so it is forgotten once
no replica can: when, at sweeps every ``SWEEP_S``, every replica the router has was seen without the
name for ``TOMBSTONE_KEEP_S`` on end. A replica holds the name, and keeps the tombstone, while its
last ``/v1/models`` read lists it or it is owed the name's unload, or, while it is healthy, until its
list is read after it (re)started; an ejected replica whose last read listed the name keeps it too,
since it may come back with it. The wait covers replicas the router does not have yet (one that
joins holding the adapter is not taken as a reason to adopt it again) and other routers' lists in
flight. Past ``TOMBSTONES_MAX`` names the oldest is forgotten, one no replica holds first, so a
router that unloads names by the thousand keeps a bounded set. This module must never import torch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from router.replica import Health, Replica

log = logging.getLogger("ferry.router")

TOMBSTONE_KEEP_S = 600.0  # seconds every replica must be seen without a name before it is forgotten
TOMBSTONES_MAX = 256
SWEEP_S = 5.0  # how often the replicas are checked for the names (MODELS_REFRESH_S: their lists' age)


def held(name: str, replicas: Iterable[Replica]) -> bool:
    """Whether one of ``replicas`` may still hold adapter ``name`` (module docstring)."""
    for r in replicas:
        if name in r.lora_unloads:
            return True
        if r.lora_seen is None:
            if r.health is Health.HEALTHY:  # read at its next probe: wait for it
                return True
        elif name in r.lora_seen:
            return True
    return False


class Tombstones:
    """Unloaded adapter names (oldest unload first) -> since when no replica holds them (None: one may)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._clear_since: dict[str, float | None] = {}
        self._next_sweep = float("-inf")

    def __contains__(self, name: str) -> bool:
        return name in self._clear_since

    def names(self) -> list[str]:
        return sorted(self._clear_since)

    def add(self, name: str, replicas: Iterable[Replica]) -> None:
        """``name`` was unloaded now."""
        self._clear_since.pop(name, None)  # the newest unload goes last
        self._clear_since[name] = None
        if len(self._clear_since) > TOMBSTONES_MAX:
            everyone = list(replicas)
            victim = next((n for n in self._clear_since if not held(n, everyone)), None)
            if victim is None:
                victim = next(iter(self._clear_since))
                log.warning(
                    "LoRA adapter %r: more than %d unloaded adapter names remembered, forgetting the "
                    "oldest though a replica may still hold it (it may be adopted again from there)",
                    victim,
                    TOMBSTONES_MAX,
                )
            del self._clear_since[victim]

    def discard(self, name: str) -> None:
        """A load of ``name`` was made or seen: it is no longer unloaded."""
        self._clear_since.pop(name, None)

    def sweep(self, replicas: Iterable[Replica]) -> None:
        """Forget the names no replica has held for ``TOMBSTONE_KEEP_S`` (at most every ``SWEEP_S``)."""
        now = self._clock()
        if now < self._next_sweep or not self._clear_since:
            return
        self._next_sweep = now + SWEEP_S
        everyone = list(replicas)
        for name, since in list(self._clear_since.items()):
            if held(name, everyone):
                self._clear_since[name] = None
            elif since is None:
                self._clear_since[name] = now
            elif now - since >= TOMBSTONE_KEEP_S:
                log.info(
                    "LoRA adapter %r: no replica has held it for %.0fs, unload forgotten", name, now - since
                )
                del self._clear_since[name]
