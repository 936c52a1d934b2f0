"""KV block events on a Redis stream per model, for cache-aware routers (torch-free).

Stream ``ferry:kv:events:{fingerprint}``; each entry has the fields

    kind     "stored" | "removed" | "cleared"
    replica  the publishing replica's id
    medium   "device" (the replica's own prefix cache) | "tier" (the shared KV tier)
    hashes   comma-separated 32-char hex block hashes (empty for "cleared")
    ts       publisher's wall-clock time (seconds, float)
    instance the publishing engine's instance id (the ``instance_id`` of the replica's ``/health``,
             new at each start); absent from publishers that have none (and from older ones)

A replica that restarts keeps its ``replica`` id but not its blocks: ``instance`` tells a router
which events are the new process's, whichever of its events and its ``/health`` it reads first.

Publishing is best effort: bounded by socket timeouts, behind a circuit breaker, trimmed with
``XADD MAXLEN ~`` so the stream never grows without bound, and it never raises. A router reads
with ``KVEventReader`` and folds events into a ``PrefixIndex`` to ask "which replica holds the
longest prefix of these blocks on its device, and how much of it is in the tier".
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvcache.breaker import CircuitBreaker, classify_error
from kvcache.keys import KEY_PREFIX
from kvcache.metrics import ErrorCounter

logger = logging.getLogger(__name__)

STORED, REMOVED, CLEARED = "stored", "removed", "cleared"
DEVICE, TIER = "device", "tier"
_KINDS = (STORED, REMOVED, CLEARED)
_MEDIA = (DEVICE, TIER)


def events_stream(fingerprint: str) -> str:
    return f"{KEY_PREFIX}:events:{fingerprint}"


def default_replica_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _client(redis_url: str, timeout: float) -> redis.Redis:
    return redis.Redis.from_url(
        redis_url,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
        health_check_interval=0,
    )


@dataclass(frozen=True)
class KVEvent:
    event_id: str
    kind: str
    replica_id: str
    medium: str
    block_hashes: tuple[str, ...]
    ts: float
    instance: str | None = None  # the publishing engine's instance id, if it named one


class KVEventPublisher:
    """Appends events for one replica; never raises (failures are counted and logged)."""

    def __init__(
        self,
        redis_url: str,
        fingerprint: str,
        replica_id: str | None = None,
        *,
        maxlen: int = 100_000,
        timeout: float = 0.5,
        instance_id: str | None = None,
    ) -> None:
        self.stream = events_stream(fingerprint)
        self.replica_id = replica_id or default_replica_id()
        self.instance_id = instance_id
        self.maxlen = maxlen
        self._client = _client(redis_url, timeout)
        self._breaker = CircuitBreaker(failure_threshold=3, cooldown_s=1.0)
        self.errors = ErrorCounter()
        self.published = 0

    def publish(self, kind: str, block_hashes: Iterable[bytes | str], medium: str = DEVICE) -> bool:
        if kind not in _KINDS or medium not in _MEDIA:
            raise ValueError(f"bad KV event kind/medium: {kind!r}/{medium!r}")
        hexes = [h.hex() if isinstance(h, bytes) else h for h in block_hashes]
        if kind != CLEARED and not hexes:
            return True
        if not self._breaker.allow():
            return False
        fields = {
            "kind": kind,
            "replica": self.replica_id,
            "medium": medium,
            "hashes": ",".join(hexes),
            "ts": repr(time.time()),
        }
        if self.instance_id:
            fields["instance"] = self.instance_id
        try:
            self._client.xadd(self.stream, fields, maxlen=self.maxlen, approximate=True)
        except Exception as exc:
            self.errors.record(classify_error(exc))
            self._breaker.record_failure()
            logger.debug("publishing KV event failed: %r", exc)
            return False
        self._breaker.record_success()
        self.published += 1
        return True

    def close(self) -> None:
        self._client.close()


class KVEventReader:
    """Reads a model's event stream from a position onwards (``"0"``: everything kept, ``"$"``: new only).

    Raises redis errors to its caller: a router's discovery loop decides how to back off.
    """

    def __init__(
        self, redis_url: str, fingerprint: str, *, start_id: str = "0", timeout: float = 2.0
    ) -> None:
        self.stream = events_stream(fingerprint)
        self.last_id = start_id
        self._client = _client(redis_url, timeout)
        if start_id == "$":
            # Pin "$" to a concrete id now, so events published between two reads are not skipped.
            info = self._client.xinfo_stream(self.stream) if self._client.exists(self.stream) else None
            self.last_id = info["last-generated-id"].decode() if info else "0"

    def read(self, count: int = 1000, block_ms: int | None = None) -> list[KVEvent]:
        reply = self._client.xread({self.stream: self.last_id}, count=count, block=block_ms)
        events: list[KVEvent] = []
        for _stream, entries in reply or []:
            for raw_id, fields in entries:
                self.last_id = raw_id.decode()
                event = _parse(self.last_id, fields)
                if event is not None:
                    events.append(event)
        return events

    def close(self) -> None:
        self._client.close()


def _parse(event_id: str, fields: dict[bytes, bytes]) -> KVEvent | None:
    try:
        kind = fields[b"kind"].decode()
        medium = fields[b"medium"].decode()
        hashes = fields[b"hashes"].decode()
        instance = fields.get(b"instance", b"").decode()
        if kind not in _KINDS or medium not in _MEDIA:
            return None
        return KVEvent(
            event_id=event_id,
            kind=kind,
            replica_id=fields[b"replica"].decode(),
            medium=medium,
            block_hashes=tuple(h for h in hashes.split(",") if h),
            ts=float(fields[b"ts"]),
            instance=instance or None,
        )
    except (KeyError, ValueError, UnicodeDecodeError):
        logger.debug("skipping malformed KV event %s", event_id)
        return None


class PrefixIndex:
    """Which blocks each replica holds on its device, and which the tier holds, from events."""

    def __init__(self) -> None:
        self.device: dict[str, set[str]] = {}
        self.tier: set[str] = set()

    def apply(self, event: KVEvent) -> None:
        if event.medium == TIER:
            target = self.tier
        else:
            target = self.device.setdefault(event.replica_id, set())
        if event.kind == STORED:
            target.update(event.block_hashes)
        elif event.kind == REMOVED:
            target.difference_update(event.block_hashes)
        else:
            target.clear()

    def apply_all(self, events: Iterable[KVEvent]) -> None:
        for event in events:
            self.apply(event)

    def forget_replica(self, replica_id: str) -> None:
        self.device.pop(replica_id, None)

    def device_prefix(self, block_hashes: Sequence[str]) -> dict[str, int]:
        """Per replica, how many leading blocks of ``block_hashes`` it holds on its device."""
        out: dict[str, int] = {}
        for replica, held in self.device.items():
            n = 0
            while n < len(block_hashes) and block_hashes[n] in held:
                n += 1
            out[replica] = n
        return out

    def tier_prefix(self, block_hashes: Sequence[str]) -> int:
        n = 0
        while n < len(block_hashes) and block_hashes[n] in self.tier:
            n += 1
        return n
