"""Exact cache knowledge for cache_aware: fold replicas' KV block events into the prefix index.

Replicas started with ``--kv-events`` publish block stored/removed/cleared events on Redis streams
``ferry:kv:events:{model_fingerprint}`` (``kvcache/events.py``). With ``--kv-tier redis://…`` the
router follows every such stream and applies *device* events of known replicas to the same
``PrefixIndex`` its routing history feeds: stored → the replica holds the blocks, removed → it no
longer does, cleared → it holds nothing. An event's ``replica`` field must be the replica's URL as
the router knows it (``ferry serve --advertise-url``); events of unknown replicas are counted and
skipped. Tier events are ignored here: every replica can load tier blocks, so they do not change
which replica is best.

A restarted replica keeps its URL but not its blocks, and the router learns of the restart two
ways that race: the ``instance`` its events name, and the ``instance_id`` its ``/health`` names.
The index must hold one instance's blocks per replica, whichever comes first, so per replica the
follower keeps the instance whose blocks the index holds (``_Replica``):

* an event of that instance is applied;
* an event of an instance that instance has handed over from (``retired``) is stale: skipped (a
  router reading a stream from its start, or catching up after a Redis outage, meets many);
* an event of an unseen instance after that instance's own events were read is a restart seen
  first in the stream (a stream is in order): the replica's entries are dropped, then it applies;
* an event of the instance ``/health`` names switches the index to its instance;
* one the router cannot place yet (no event of the current instance read, and ``/health`` names
  another or none yet: a replica down when the router starts and reads the stream) is held until
  ``/health`` names its instance (``settle``), or dropped when a later one shows up.

A prefix-cache reset (``POST /reset_prefix_cache``, sleep; refused while requests run) is in a
replica's events: a ``removed`` for each block it dropped, in stream order between the ``stored``
of blocks cached before it and after it. So for a replica whose events are followed (``follows``),
a reset the router sees (its fan-out, or ``/health``'s ``prefix_cache_resets``) changes nothing
here: applying the stream in order gives the replica's cache whichever the router reads first.

A restart the health probe sees first (``restarted``) drops the replica's entries, unless its
events already moved the index to that very instance: then those blocks are the new process's
and are kept. Events without an ``instance`` (older replicas) are applied as they come.

Missed events (``kvcache/events.py``) leave the index holding what a replica said before the gap,
perhaps blocks a reset lost in the gap removed: routing quality suffers, never correctness. So on
a gap the replica's entries go (routing history's too) and the index learns it again from the
events after the gap, as after a restart. A gap is one of:

* ``sequence``: an event of the instance the index holds (or holds back) numbers past the one
  read before it (``seq``): the replica could not append events (Redis down, its breaker open);
  only that replica is dropped (held events of that instance read before the gap are discarded);
* ``trimmed``: the stream lost entries the follower had not read (``MAXLEN`` while the router
  could not read, a Redis outage longer than the stream holds), or ``recreated``: the stream read
  so far is gone. Which replicas' events were lost is unknown, so every replica whose events were
  read from that stream is dropped.

Each gap is logged once and counted in ``ferry:router_kv_event_gaps_total{reason}``.

The reader is redis-py's blocking client, so reads run in a worker thread; events are applied on
the event loop (the same thread as routing and the health probe, so the index has one writer at a
time). A Redis outage only pauses exact updates (routing history keeps working) and is retried
with backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter

from kvcache.tier import redact_url
from router.discovery import normalize_url
from router.prefix_index import PrefixIndex

log = logging.getLogger("ferry.router")
STREAM_PATTERN = "ferry:kv:events:*"
MAX_HELD_EVENTS = 4096  # per replica: events of instances not placed yet (beyond: the oldest go)
MAX_RETIRED = 16  # per replica: instances remembered as gone
APPLY_SLICE = 512  # events applied between yields to the event loop (~1 ms)

APPLIED, UNKNOWN_REPLICA, STALE, HELD, DISCARDED = "applied", "unknown_replica", "stale", "held", "discarded"
OUTCOMES = (APPLIED, UNKNOWN_REPLICA, STALE, HELD, DISCARDED)
GAP_REASONS = ("sequence", "trimmed", "recreated")  # kinds of missed events (module docstring)


@dataclass(frozen=True)
class StreamGap:
    """Read in place of the entries a stream lost: they were published by (some of) ``replica_ids``,
    the publishers read from ``stream`` before the gap."""

    stream: str
    reason: str  # "trimmed" | "recreated"
    replica_ids: frozenset[str]


@dataclass
class _Replica:
    """What the index holds of one replica's events (module docstring)."""

    instance: str | None = None  # whose blocks the index holds (None: no instance named yet)
    confirmed: bool = False  # an event of ``instance`` was read: unseen instances after it are newer
    retired: deque[str] = field(default_factory=lambda: deque(maxlen=MAX_RETIRED))
    held: dict[str, list[Any]] = field(default_factory=dict)  # instance -> its events, in order
    num_held: int = 0
    # (stream, instance) -> the last ``seq`` read of it (numbered per stream: kvcache/events.py)
    seqs: dict[tuple[str | None, str | None], int] = field(default_factory=dict)


class KVEventFollower:
    def __init__(
        self,
        redis_url: str,
        index: PrefixIndex,
        known_url: Callable[[str], bool],
        block_ms: int = 200,
        instance_of: Callable[[str], str | None] = lambda url: None,
        counter: Counter | None = None,
        gap_counter: Counter | None = None,
    ):
        from kvcache.redis_tier import client_url

        self.redis_url = redis_url
        self.client_url = client_url(redis_url)  # the router's --kv-tier: a tier URL, its parameters too
        self.index = index
        self.known_url = known_url
        self.instance_of = instance_of  # the instance a replica's /health named last (None: none)
        self.block_ms = block_ms
        self.readers: dict[str, object] = {}  # stream name -> kvcache.events.KVEventReader
        self.counts = dict.fromkeys(OUTCOMES, 0)
        self.gaps = dict.fromkeys(GAP_REASONS, 0)
        self._publishers: dict[str, set[str]] = {}  # stream -> replica ids read from it (reader thread)
        self._replicas: dict[str, _Replica] = {}
        self._counter = counter  # ferry:router_kv_events_total{outcome} (router/metrics.py)
        self._gap_counter = gap_counter  # ferry:router_kv_event_gaps_total{reason}
        self._task: asyncio.Task | None = None

    @property
    def applied(self) -> int:
        return self.counts[APPLIED]

    @property
    def skipped(self) -> int:
        return self.counts[UNKNOWN_REPLICA]

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="ferry-router-kv-events")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for reader in self.readers.values():
            with contextlib.suppress(Exception):
                reader.close()  # type: ignore[attr-defined]

    def read_new(self) -> list[Any]:
        """Discover streams and read what is new (``kvcache.events.KVEvent`` s, a ``StreamGap``
        before those read after a gap). Blocking: call from a worker thread."""
        import redis

        from kvcache.events import KVEventReader

        client = redis.Redis.from_url(self.client_url, socket_timeout=2.0, socket_connect_timeout=2.0)
        try:
            streams = [k.decode() for k in client.scan_iter(match=STREAM_PATTERN, count=100)]
        finally:
            client.close()
        events: list[Any] = []
        for name in dict.fromkeys([*streams, *self.readers]):  # a stream gone too: that is a gap
            reader = self.readers.get(name)
            if reader is None:
                fingerprint = name.rsplit(":", 1)[1]
                reader = self.readers[name] = KVEventReader(self.client_url, fingerprint, start_id="0")
            batch, gap = reader.read_checked(count=10_000)  # type: ignore[attr-defined]
            publishers = self._publishers.setdefault(name, set())
            if gap is not None:
                events.append(StreamGap(name, gap, frozenset(publishers)))
                publishers.clear()
            publishers.update(event.replica_id for event in batch)
            events.extend(batch)
        return events

    def poll_once(self) -> int:
        """Read what is new and apply it; how many events were applied."""
        return sum(self.apply(event) for event in self.read_new()) + self.settle()

    def settle(self) -> int:
        """Apply the held events of each replica whose /health names their instance now (its first
        probe came after them); how many were applied."""
        applied = 0
        for url, state in list(self._replicas.items()):
            health = self.instance_of(url) if state.held else None
            if health is not None and health in state.held:
                before = self.counts[APPLIED]
                self._switch(url, state, health, confirmed=True)
                applied += self.counts[APPLIED] - before
        return applied

    def apply(self, event: Any) -> int:  # event: kvcache.events.KVEvent or StreamGap
        if isinstance(event, StreamGap):
            self._stream_gap(event)
            return 0
        url = _url(event.replica_id)
        if not self.known_url(url):
            if event.medium == "device":
                self._count(UNKNOWN_REPLICA)
            return 0
        instance = event.instance
        if event.medium != "device":  # not applied, but numbered in the same sequence
            state = self._replicas.get(url)
            if state is not None and (instance == state.instance or instance in state.held):
                self._sequence(url, state, event)
            return 0
        state = self._replicas.setdefault(url, _Replica())
        if instance is None:  # a publisher that names no instance: as it comes
            self._sequence(url, state, event)
            return self._apply(url, event)
        if instance == state.instance:
            state.confirmed = True
            self._sequence(url, state, event)
            return self._apply(url, event)
        if instance in state.retired:
            self._count(STALE)
            return 0
        # Placed: after the current instance's own events (so newer), or the one /health names now.
        if state.confirmed or instance == self.instance_of(url):
            self._switch(url, state, instance, confirmed=True)
            self._sequence(url, state, event)
            return self._apply(url, event)
        self._sequence(url, state, event)
        self._hold(state, instance, event)
        return 0

    def restarted(self, url: str, instance: str | None) -> None:
        """The health probe saw replica ``url`` restart as ``instance``: forget the previous
        instance's blocks (and the routing history), unless its events showed this one first."""
        state = self._replicas.setdefault(url, _Replica())
        if instance is not None and instance == state.instance:
            return
        if instance is None:
            self.index.drop_replica(url)
            self._replicas.pop(url, None)
            return
        if state.instance is None:  # the routing history's entries (_switch drops an instance's)
            self.index.drop_replica(url)
        self._switch(url, state, instance, confirmed=False)

    def forget(self, url: str) -> None:
        """Replica ``url`` left the router."""
        self._replicas.pop(url, None)

    def follows(self, url: str) -> bool:
        """The index holds what the events of replica ``url``'s running process (the instance its
        /health names) said, so a prefix-cache reset there is theirs to tell (module docstring):
        dropping the replica's entries on seeing the reset would also drop blocks cached after it
        whose events were read before the reset was seen."""
        state = self._replicas.get(url)
        return state is not None and state.instance is not None and state.instance == self.instance_of(url)

    def _switch(self, url: str, state: _Replica, instance: str, confirmed: bool) -> None:
        """The index holds ``instance``'s blocks of ``url`` from now on (the previous instance's go)."""
        if state.instance is not None:
            self.index.drop_replica(url)
            state.retired.append(state.instance)
        state.instance, state.confirmed = instance, confirmed
        state.seqs = {key: seq for key, seq in state.seqs.items() if key[1] == instance}
        held = state.held.pop(instance, [])
        # Held events of other instances are older than this one's, or cannot be placed: never applied.
        self._count(DISCARDED, state.num_held - len(held))
        state.held, state.num_held = {}, 0
        if held:
            state.confirmed = True
        for event in held:
            self._apply(url, event)

    def _sequence(self, url: str, state: _Replica, event: Any) -> None:
        """Note ``event``'s number; past the next one expected, the events between were missed."""
        if event.seq is None:
            return
        key = (event.stream, event.instance)
        last = state.seqs.get(key)
        state.seqs[key] = event.seq
        if last is None or event.seq <= last + 1:  # first read of it, or the next one (or a restart)
            return
        if event.instance == state.instance:
            self.index.drop_replica(url)
        else:  # held: its events before the gap would rebuild a cache that has changed since
            dropped = state.held.pop(event.instance, [])
            state.num_held -= len(dropped)
            self._count(DISCARDED, len(dropped))
        self._gap(
            "sequence",
            "replica %s (instance %s) published events %d to %d the router never read; its "
            "entries in the prefix index are dropped until its next events",
            url,
            event.instance,
            last + 1,
            event.seq - 1,
        )

    def _stream_gap(self, gap: StreamGap) -> None:
        """Entries of ``gap.stream`` were lost unread: forget what each replica read from it said."""
        dropped = []
        for url in sorted({_url(r) for r in gap.replica_ids}):
            state = self._replicas.get(url)
            if state is None or not self.known_url(url):
                continue
            self.index.drop_replica(url)
            self._count(DISCARDED, state.num_held)
            state.held, state.num_held, state.seqs = {}, 0, {}  # numbers past the gap start afresh
            dropped.append(url)
        self._gap(
            gap.reason,
            "KV event stream %s lost entries the router had not read (%s); dropped the prefix "
            "index entries of %s until their next events",
            gap.stream,
            gap.reason,
            ", ".join(dropped) or "no replica",
        )

    def _gap(self, reason: str, message: str, *args: object) -> None:
        self.gaps[reason] += 1
        if self._gap_counter is not None:
            self._gap_counter.labels(reason).inc()
        log.warning(message, *args)

    def _hold(self, state: _Replica, instance: str, event: Any) -> None:
        if state.num_held >= MAX_HELD_EVENTS:
            oldest = next(iter(state.held))
            dropped = state.held.pop(oldest)
            state.seqs = {key: seq for key, seq in state.seqs.items() if key[1] != oldest}
            state.num_held -= len(dropped)
            self._count(DISCARDED, len(dropped))
        state.held.setdefault(instance, []).append(event)
        state.num_held += 1
        self._count(HELD)

    def _apply(self, url: str, event: Any) -> int:
        if event.kind == "cleared":
            self.index.drop_replica(url)
        else:
            hashes = [bytes.fromhex(h) for h in event.block_hashes]
            if event.kind == "stored":
                self.index.insert(hashes, url)
            else:
                self.index.remove(hashes, url)
        self._count(APPLIED)
        return 1

    def _count(self, outcome: str, n: int = 1) -> None:
        if not n:
            return
        self.counts[outcome] += n
        if self._counter is not None:
            self._counter.labels(outcome).inc(n)

    async def _run(self) -> None:
        delay = 0.2
        while True:
            try:
                events = await asyncio.to_thread(self.read_new)
                delay = 0.2
                for i, event in enumerate(events, 1):  # on the loop: the index has one writer
                    self.apply(event)
                    if i % APPLY_SLICE == 0:  # a long backlog must not stall the streams relayed
                        await asyncio.sleep(0)
                self.settle()
                if not events:
                    await asyncio.sleep(0.2)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis outage: history-based routing continues meanwhile
                log.warning("reading KV events from %s failed: %s", redact_url(self.redis_url), e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)


def _url(replica_id: str) -> str:
    return normalize_url(replica_id) if "://" in replica_id else replica_id
