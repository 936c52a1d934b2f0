"""KV block events on a Redis stream per model, for cache-aware routers (torch-free).

Stream ``ferry:kv:events:{fingerprint}``; each entry has the fields

    kind     "stored" | "removed" | "cleared"
    replica  the publishing replica's id
    medium   "device" (the replica's own prefix cache) | "tier" (the shared KV tier)
    hashes   comma-separated 32-char hex block hashes (empty for "cleared")
    ts       publisher's wall-clock time (seconds, float)
    instance the publishing engine's instance id (the ``instance_id`` of the replica's ``/health``,
             new at each start); absent from publishers that have none (and from older ones)
    seq      the publisher's event number in this stream, 1, 2, 3 … from its start, counting every
             event it meant to append, also those it could not (Redis down, breaker open, the
             write queue full); absent from older ones. Numbered per stream: after a weight update a replica's events queued
             before it still go to the old model's stream, between ones of the new model's.

A replica that restarts keeps its ``replica`` id but not its blocks: ``instance`` tells a router
which events are the new process's, whichever of its events and its ``/health`` it reads first.
A router that missed events learns it two ways: a publisher's ``seq`` jumps (the events it could
not append), or the stream lost entries it had not read yet (``KVEventReader.read_checked``:
trimmed by ``MAXLEN`` while the router was away, or the stream deleted and created again).

Redis does not say when it evicts or expires a block: a replica that finds a block gone which it
had seen held (a lookup, a load, a re-publication check) publishes a ``removed`` tier event for it
(``kvcache/tier_presence.py``); block hashes chain, so a reader's ``tier_prefix`` stops there.
Until some replica reads it, an evicted block stays ``stored`` in the stream.

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

from kvcache.breaker import CircuitBreaker, classify_error, error_text
from kvcache.keys import KEY_PREFIX
from kvcache.log_limit import RateLimitedLog
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
    seq: int | None = None  # the publisher's event number in ``stream``, if it numbers them
    stream: str | None = None  # the stream it was read from (``KVEventReader``)


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
        # A Redis that refuses the events (full under ``noeviction``, a read-only replica, MISCONF) or
        # is down: one line a minute says so (readers see the gaps in ``seq``).
        self._failure_log = RateLimitedLog(logger, burst=1, window=60.0)
        self.published = 0
        self.seqs: dict[str, int] = {}  # stream -> events meant for it so far, appended or not

    def publish(
        self,
        kind: str,
        block_hashes: Iterable[bytes | str],
        medium: str = DEVICE,
        fingerprint: str | None = None,
    ) -> bool:
        """Append one event to ``fingerprint``'s stream (None: the publisher's, ``stream``)."""
        if kind not in _KINDS or medium not in _MEDIA:
            raise ValueError(f"bad KV event kind/medium: {kind!r}/{medium!r}")
        hexes = [h.hex() if isinstance(h, bytes) else h for h in block_hashes]
        if kind != CLEARED and not hexes:
            return True
        stream = self.stream if fingerprint is None else events_stream(fingerprint)
        # Numbered before any refusal, so a reader sees the number it missed (one writer thread).
        seq = self.seqs[stream] = self.seqs.get(stream, 0) + 1
        if not self._breaker.allow():
            return False
        fields = {
            "kind": kind,
            "replica": self.replica_id,
            "medium": medium,
            "hashes": ",".join(hexes),
            "ts": repr(time.time()),
            "seq": str(seq),
        }
        if self.instance_id:
            fields["instance"] = self.instance_id
        try:
            self._client.xadd(stream, fields, maxlen=self.maxlen, approximate=True)
        except Exception as exc:
            kind = classify_error(exc)
            self.errors.record(kind)
            self._breaker.record_failure()
            self._failure_log.warning(
                "publishing KV events to %s failed (%s; events are dropped meanwhile): %s",
                stream,
                kind,
                error_text(exc),
            )
            return False
        self._breaker.record_success()
        self.published += 1
        return True

    def skip(self, n: int, fingerprint: str | None = None) -> None:
        """Number ``n`` events meant for ``fingerprint``'s stream that never reached the publisher
        (its queue was full): the next event appended shows readers the gap. Same thread as
        ``publish``."""
        stream = self.stream if fingerprint is None else events_stream(fingerprint)
        self.seqs[stream] = self.seqs.get(stream, 0) + n

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
        self.offset = 0  # which entry of the stream ``last_id`` is (``read_checked``)
        self._client = _client(redis_url, timeout)
        if start_id == "$":
            # Pin "$" to a concrete id now, so events published between two reads are not skipped.
            info = self._client.xinfo_stream(self.stream) if self._client.exists(self.stream) else None
            self.last_id = info["last-generated-id"].decode() if info else "0"
            self.offset = info.get("entries-added", 0) if info else 0

    def read(self, count: int = 1000, block_ms: int | None = None) -> list[KVEvent]:
        reply = self._client.xread({self.stream: self.last_id}, count=count, block=block_ms)
        return self._events(reply)

    def read_checked(self, count: int = 1000) -> tuple[list[KVEvent], str | None]:
        """``read``, and whether entries after ``last_id`` were lost before this read could see
        them: ``"trimmed"`` (``MAXLEN`` or ``XTRIM`` removed entries not read yet), ``"recreated"``
        (the stream read so far is gone: deleted, or a Redis restarted empty; reading starts over
        from the new stream's first entry), ``None`` when nothing was missed (or nothing read yet:
        nothing to miss). The check and the read are one transaction, so a trim between them
        cannot hide a gap, nor one after them invent one.

        The stream's ``entries-added`` (Redis 7) numbers its entries: ``offset`` is the number of
        the last one read. Trimming removes the oldest entries, ``entries-added - length`` of
        them; more than ``offset`` means some were never read. Fewer, with the last one read gone,
        means it was never in this stream: a new one. (Redis < 7: the last one read gone is
        counted a trim; an ``XDEL``, which ferry never sends, reads as one too.)"""
        since = self.last_id
        pipe = self._client.pipeline(transaction=True)
        pipe.xinfo_stream(self.stream)
        pipe.xrange(self.stream, since, since, count=1)
        pipe.xread({self.stream: since}, count=count)
        info, at_since, reply = pipe.execute(raise_on_error=False)
        if isinstance(info, redis.ResponseError) and "no such key" in str(info).lower():
            self.last_id, self.offset = "0", 0
            return [], None if since == "0" else "recreated"
        for result in (info, at_since, reply):
            if isinstance(result, Exception):
                raise result
        gap = None if since == "0" else _gap(info, bool(at_since), _id(since), self.offset)
        if gap == "recreated":
            self.last_id, self.offset = "0", 0
            return self.read_checked(count)[0], gap
        events = self._events(reply)
        read = sum(len(entries) for _stream, entries in reply or [])
        trimmed = info.get("entries-added", 0) - info["length"]
        # The entries read follow the last one read, or (it gone) the ones trimmed.
        self.offset = (self.offset if at_since else trimmed) + read
        return events, gap

    def _events(self, reply: object) -> list[KVEvent]:
        events: list[KVEvent] = []
        for _stream, entries in reply or []:  # type: ignore[attr-defined]
            for raw_id, fields in entries:
                self.last_id = raw_id.decode()
                event = _parse(self.last_id, fields, self.stream)
                if event is not None:
                    events.append(event)
        return events

    def close(self) -> None:
        self._client.close()


def _id(entry_id: str | bytes) -> tuple[int, int]:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def _gap(info: dict, since_kept: bool, since: tuple[int, int], offset: int) -> str | None:
    """What ``XINFO STREAM`` says of the entries after ``since``, the last one read, number
    ``offset`` (``since_kept``: still in the stream); see ``KVEventReader.read_checked``."""
    deleted = info.get("max-deleted-entry-id")  # XDEL (and XSETID) only: trims leave it
    if since_kept:
        return "trimmed" if deleted is not None and _id(deleted) > since else None
    if _id(info["last-generated-id"]) < since:
        return "recreated"
    added = info.get("entries-added")
    if added is None:  # Redis < 7
        return "trimmed"
    trimmed = added - info["length"]
    if trimmed > offset:
        return "trimmed"
    return "recreated" if trimmed < offset and (deleted is None or _id(deleted) < since) else None


def _parse(event_id: str, fields: dict[bytes, bytes], stream: str) -> KVEvent | None:
    try:
        kind = fields[b"kind"].decode()
        medium = fields[b"medium"].decode()
        hashes = fields[b"hashes"].decode()
        instance = fields.get(b"instance", b"").decode()
        seq = fields.get(b"seq")
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
            seq=int(seq) if seq is not None else None,
            stream=stream,
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
