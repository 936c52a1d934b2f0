"""The background writer of the KV connector: a bounded queue of block writes and events.

The engine thread hands over host snapshots of blocks; one daemon thread encodes them and
writes them in batches. The bound is on *pending* items (queued or being written), reserved
before the caller takes a snapshot, so a full queue costs the caller nothing and never blocks:
the write is dropped and counted in ``ferry:kv_tier_dropped_writes_total``. Writes that the
tier refuses or loses (Redis down, even mid-write; a full Redis; a memory bound) are counted there
too, block by block: every block handed over ends as exactly one of ``written`` or ``dropped``.
``close(timeout)`` keeps that true when the tier does not answer in time: what is still queued, and
the batch whose write is still waiting on the tier, count as dropped when ``close`` gives up (the
thread that finishes that write later counts nothing), so the counts are final when it returns.
Events ride the same queue, after the writes they describe, and consecutive events of one kind
are coalesced into one stream entry.

The hashes of the blocks dropped for a full queue are remembered (``MAX_DROPPED_REMEMBERED`` at most;
past that only the fact that more were dropped): those blocks keep hitting in the replica's own
prefix cache, so nothing would write them again; the re-publication pass (``kvcache/republish.py``)
takes them (``take_dropped``) once the queue has room and writes those the tier still lacks.

Writes the server refuses while it answers (the breaker stays closed) are counted by the refusal's
reason (``oom``: over ``maxmemory`` under ``noeviction``; ``readonly``: a replica, as the old primary
after a failover; ``misconf``: writes stopped for failing RDB saves; ``refused``: anything else, an
ACL's NOPERM). The first three pass by themselves, so their blocks are remembered as well (the same
bound) and handed to the re-publication pass with a back-off: ``REFUSED_RETRY_S`` after the first
refusal, doubled each round that is refused again (up to ``REFUSED_RETRY_MAX_S``), back to the start
once a batch is acknowledged whole. One round at most per back-off, never a loop of refused writes;
``retry_due_in`` tells an idle engine when to wake for it. ``refused`` ones are only counted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from engine.torch_threads import set_this_thread_count
from kvcache import codec
from kvcache.keys import tier_key
from kvcache.log_limit import RateLimitedLog
from kvcache.metrics import (
    DROP_CLOSED,
    DROP_ENCODE,
    DROP_QUEUE_FULL,
    DROP_RETRYABLE,
    DROP_SNAPSHOT,
    DROP_TIER,
    KV_TIER_DROPPED_WRITES,
    KV_TIER_REPUBLISHED,
)
from kvcache.tier import Tier, take_refused

if TYPE_CHECKING:
    from kvcache.events import KVEventPublisher
    from kvcache.tier_presence import TierPresence

logger = logging.getLogger(__name__)

WRITE_BATCH = 32  # blocks per tier write
# Hashes of queue-full drops kept for re-publication (~100 bytes each); more dropped before the
# next pass take means the pass checks the whole prefix cache instead.
MAX_DROPPED_REMEMBERED = 4096
# Acknowledged writes remembered with their number (``covers``): a re-publication pass skips a
# block written since it started. Past that many writes during one pass, the oldest are forgotten
# (the pass may then write such a block once more: never one less).
MAX_ACKS_REMEMBERED = 16384
# Writes the server refused for a passing reason (``DROP_RETRYABLE``) are tried again this long after
# the first refusal, the wait doubled after each round refused again, up to the maximum.
REFUSED_RETRY_S = 1.0
REFUSED_RETRY_MAX_S = 60.0
# Block events are a few hashes each: they may fill the queue this many items past the writes'
# capacity, so a queue full of block writes (a slow tier) does not also cost the routers their
# view of this replica's caches. Past that an event is missed, and its number skipped (``seq``):
# a reader sees the gap and relearns this replica from its later events (``router/kv_events.py``).
EVENT_HEADROOM = 1024


@dataclass(frozen=True)
class BlockWrite:
    block_hash: bytes
    tensor: torch.Tensor  # host snapshot of one block
    # The model fingerprint the block was computed under (None: the writer's): a write queued
    # before a weight update still lands under the old weights' key.
    fingerprint: str | None = None
    # Written again by a re-publication pass (``kvcache/republish.py``), not because it just filled:
    # counted apart (``ferry:kv_tier_republished_blocks_total``) once the tier acknowledged it.
    republish: bool = False


@dataclass(frozen=True)
class BlockEvent:
    kind: str
    hashes: tuple[bytes, ...]
    medium: str
    # The model whose stream it goes to (None: the publisher's): an event queued before a weight
    # update still describes the old weights' blocks, even if published after it.
    fingerprint: str | None = None


class WriterCounts(NamedTuple):
    written: int
    dropped: int
    pending: int  # items (writes, events) queued or in hand, less the writes counted already
    republished: int = 0  # of ``written``: re-publication writes


class BlockWriter:
    def __init__(
        self, tier: Tier, fingerprint: str, capacity: int, publisher: KVEventPublisher | None = None
    ) -> None:
        if capacity < 1:
            raise ValueError("write queue capacity must be >= 1")
        self.tier = tier
        self.fingerprint = fingerprint
        self.capacity = capacity
        self.publisher = publisher
        # Unbounded by itself: ``_pending`` is the bound, so nothing ever blocks on the queue.
        # Items are taken off it under ``_lock``, so close() always knows where each one is.
        self._queue: deque[object] = deque()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._stopping = False  # the thread ends once the queue is empty
        self._pending = 0
        self._pending_hashes: Counter[bytes] = Counter()
        self._closed = False
        self._given_up = False  # close's timeout passed: whatever is left counts as dropped
        # The batch the thread took and has not settled (None: none, or close counted it);
        # ``_batch_counted``: its writes are counted already (events still to publish).
        self._batch: list[object] | None = None
        self._batch_counted = False
        self.written = 0
        self.dropped = 0
        self.republished = 0
        # Dropped for a full queue, not yet taken by a re-publication pass (insertion order: parents
        # first); ``_dropped_overflow``: more were dropped than it holds.
        self._dropped_hashes: dict[bytes, None] = {}
        self._dropped_overflow = False
        # Refused by the server for a passing reason, not yet taken (``take_dropped``): tried again
        # from ``_refused_retry_at`` on; ``_refused_backoff`` is the wait of the next round.
        self._refused_hashes: dict[bytes, None] = {}
        self._refused_overflow = False
        self._refused_retry_at = 0.0
        self._refused_backoff = REFUSED_RETRY_S
        self._refusal_log = RateLimitedLog(logger, burst=1, window=60.0)
        # Events missed for a full queue, per model (None: the publisher's), not yet numbered in
        # the publisher's sequence (the writer thread does it before publishing its next events).
        self._missed_events: Counter[str | None] = Counter()
        self.events_missed = 0
        self._missed_log = RateLimitedLog(logger, burst=1, window=60.0)
        # Acknowledged writes: how many so far, and the latest number of each recent block's.
        self._acks = 0
        self._acked: OrderedDict[bytes, int] = OrderedDict()
        # The blocks the tier acknowledged are noted there (events on): ``kvcache/tier_presence.py``.
        self.presence: TierPresence | None = None
        self._thread = threading.Thread(target=self._run, name="kv-tier-write", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        with self._lock:
            return self._pending

    def counts(self) -> WriterCounts:
        """Written, dropped and pending writes, read together: each block handed over is in exactly
        one of them (a batch already counted, whose events are still being published, is no longer
        pending)."""
        with self._lock:
            settled = self._batch if self._batch is not None and self._batch_counted else []
            pending = self._pending - sum(isinstance(item, BlockWrite) for item in settled)
            return WriterCounts(
                written=self.written, dropped=self.dropped, pending=pending, republished=self.republished
            )

    def reserve(self, n: int, keep_free: int = 0) -> int:
        """Reserve up to ``n`` slots, leaving ``keep_free`` of them to later callers (re-publication
        leaves room for the writes of blocks that fill meanwhile); returns how many (the caller drops
        the rest via ``drop``, or, re-publishing, tries them later)."""
        with self._lock:
            got = 0 if self._closed else min(n, max(0, self.capacity - keep_free - self._pending))
            self._pending += got
            return got

    def submit(self, writes: Sequence[BlockWrite]) -> None:
        """Queue writes for slots already reserved (one slot each)."""
        with self._changed:
            if self._given_up:  # reserved before close gave up: nothing will write them now
                self._pending -= len(writes)
                self._count_dropped(len(writes), DROP_CLOSED)
                self._changed.notify_all()
                return
            self._pending_hashes.update(w.block_hash for w in writes)
            self._queue.extend(writes)
            self._changed.notify_all()

    def submit_event(self, event: BlockEvent) -> bool:
        """Queue ``event`` behind the writes queued before it: False when events are off, the
        writer closed, or even the events' headroom is full (the event is missed: counted, and its
        number skipped in the stream so that readers see a gap instead of a silently wrong view)."""
        if self.publisher is None:
            return False
        with self._changed:
            if self._closed or self._given_up:
                return False
            if self._pending >= self.capacity + EVENT_HEADROOM:
                self._missed_events[event.fingerprint] += 1
                self.events_missed += 1
                self._changed.notify_all()  # the writer thread numbers the gap before its next events
                missed = self.events_missed
            else:
                self._pending += 1
                self._queue.append(event)
                self._changed.notify_all()
                return True
        self._missed_log.warning(
            "KV tier write queue full (%d items): block events missed (%d so far); routers relearn "
            "this replica's caches from its later events",
            self.capacity + EVENT_HEADROOM,
            missed,
        )
        return False

    def cancel(self, n: int) -> None:
        """Give back ``n`` reserved slots whose writes will never be submitted (their snapshot
        failed); they count as dropped."""
        with self._changed:
            self._pending -= n
            self._changed.notify_all()
            self._count_dropped(n, DROP_SNAPSHOT)

    def drop(self, hashes: Sequence[bytes]) -> None:
        """The writes of ``hashes`` found no slot (``reserve``): the queue was full (they are
        remembered for re-publication), or the writer closed."""
        with self._lock:
            if self._closed:
                self._count_dropped(len(hashes), DROP_CLOSED)
                return
            self._count_dropped(len(hashes), DROP_QUEUE_FULL)
            for h in hashes:
                if len(self._dropped_hashes) >= MAX_DROPPED_REMEMBERED:
                    self._dropped_overflow = True
                    break
                self._dropped_hashes[bytes(h)] = None

    @property
    def has_dropped(self) -> bool:
        """Writes were dropped for a full queue since the last ``take_dropped``, or refused writes
        are due to be tried again (no lock: a hint read every engine step; ``take_dropped`` is exact)."""
        return self._dropped_overflow or bool(self._dropped_hashes) or self.retry_due_in() == 0.0

    def retry_due_in(self) -> float | None:
        """Seconds until the writes the server refused are due to be tried again (0: now), None with
        none remembered."""
        if not (self._refused_hashes or self._refused_overflow):
            return None
        return max(0.0, self._refused_retry_at - time.monotonic())

    def take_dropped(self, due_only: bool = False) -> tuple[list[bytes], bool]:
        """The hashes of the writes dropped for a full queue since the last call, then those refused
        by the server (only once their retry is due, with ``due_only``), oldest first, and whether
        more were dropped than remembered; forgets them."""
        with self._lock:
            hashes, overflow = self._dropped_hashes, self._dropped_overflow
            self._dropped_hashes, self._dropped_overflow = {}, False
            if not due_only or time.monotonic() >= self._refused_retry_at:
                hashes.update(self._refused_hashes)
                overflow = overflow or self._refused_overflow
                self._refused_hashes, self._refused_overflow = {}, False
            return list(hashes), overflow

    def free_slots(self, keep_free: int = 0) -> int:
        """How many slots ``reserve(n, keep_free)`` would grant now (n large)."""
        with self._lock:
            return 0 if self._closed else max(0, self.capacity - keep_free - self._pending)

    def ack_mark(self) -> int:
        """The number of writes acknowledged so far (for ``covers``)."""
        with self._lock:
            return self._acks

    def covers(self, block_hash: bytes, mark: int) -> bool:
        """A write of ``block_hash`` is pending, or was acknowledged after ``ack_mark`` returned
        ``mark``: writing it again would write it twice."""
        with self._lock:
            return self._pending_hashes[block_hash] > 0 or self._acked.get(block_hash, 0) > mark

    def is_pending(self, block_hash: bytes) -> bool:
        """A write of ``block_hash`` is queued or being written (not yet counted written or dropped)."""
        with self._lock:
            return self._pending_hashes[block_hash] > 0

    def _count_dropped(self, n: int, reason: str) -> None:
        # Under ``_lock``.
        if n:
            KV_TIER_DROPPED_WRITES.labels(reason=reason).inc(n)
            self.dropped += n

    def flush(self, timeout: float | None = None, hashes: Sequence[bytes] | None = None) -> bool:
        """Wait until every pending item (or just the writes of ``hashes``) was attempted."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def busy() -> bool:
            if hashes is None:
                return self._pending > 0
            return any(self._pending_hashes[h] for h in hashes)

        with self._changed:
            while busy():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._changed.wait(remaining)
        return True

    def close(self, timeout: float) -> None:
        """Write what is queued, for up to ``timeout``; then what is left is dropped and counted."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self.flush(timeout):
            with self._changed:
                self._stopping = True
                self._changed.notify_all()
            self._thread.join(timeout)
        else:
            # No join: the thread waits on the tier, and what that call returns is decided already.
            self._give_up()

    def _give_up(self) -> None:
        """Count as dropped every write not yet counted: the queued ones and the batch whose write
        is still waiting on the tier (the thread, when that write returns, counts nothing)."""
        with self._changed:
            self._given_up = self._stopping = True
            left: list[object] = []
            if self._batch is not None:
                left = [] if self._batch_counted else self._batch
                self._forget(self._batch)
                self._batch = None
            left += self._queue
            self._forget(list(self._queue))
            self._queue.clear()
            unwritten = sum(isinstance(item, BlockWrite) for item in left)
            self._count_dropped(unwritten, DROP_CLOSED)
            self._changed.notify_all()
        if unwritten:
            logger.warning("KV tier writer closed with %d block writes unwritten; dropped", unwritten)

    def _forget(self, items: list[object]) -> None:
        # Under ``_lock``: these items are no longer pending (written, dropped or given up).
        self._pending -= len(items)
        writes = [w.block_hash for w in items if isinstance(w, BlockWrite)]
        self._pending_hashes.subtract(writes)
        for h in writes:
            if self._pending_hashes[h] <= 0:
                del self._pending_hashes[h]

    def _run(self) -> None:
        set_this_thread_count(1)  # encoding never competes with the model
        while True:
            with self._changed:
                while not self._queue and not self._stopping:
                    self._changed.wait()
                if not self._queue:
                    return
                n = min(WRITE_BATCH, len(self._queue))
                batch = [self._queue.popleft() for _ in range(n)]
                self._batch, self._batch_counted = batch, False
            self._process(batch)

    def _process(self, batch: list[object]) -> None:
        writes = [b for b in batch if isinstance(b, BlockWrite)]
        try:
            done, encoded, refusal = self._write(writes) if writes else ([], [], None)
            unencoded = len(writes) - len(encoded)
            with self._lock:
                if self._batch is not batch:  # close gave up on it meanwhile and counted it
                    return
                self.written += len(done)
                for w in done:
                    self._acks += 1
                    self._acked[w.block_hash] = self._acks
                    self._acked.move_to_end(w.block_hash)
                while len(self._acked) > MAX_ACKS_REMEMBERED:
                    self._acked.popitem(last=False)
                republished = sum(w.republish for w in done)
                if republished:
                    KV_TIER_REPUBLISHED.inc(republished)
                    self.republished += republished
                self._count_dropped(unencoded, DROP_ENCODE)
                unstored = len(writes) - unencoded - len(done)
                self._count_dropped(unstored, refusal or DROP_TIER)
                if refusal in DROP_RETRYABLE and unstored:
                    acked = {id(w) for w in done}
                    self._remember_refused([w.block_hash for w in encoded if id(w) not in acked], refusal)
                elif done and not unstored:
                    self._refused_backoff = REFUSED_RETRY_S  # the tier takes writes again
                self._batch_counted = True
            if self.presence is not None and done:
                self.presence.saw(
                    (
                        tier_key(w.fingerprint or self.fingerprint, w.block_hash),
                        w.fingerprint or self.fingerprint,
                        w.block_hash,
                    )
                    for w in done
                )
            if self.publisher is not None:
                # Only the blocks the tier holds: a router that routes by these events must not
                # send a request to blocks that were never written. Each on its model's stream.
                self._publish([BlockEvent("stored", (w.block_hash,), "tier", w.fingerprint) for w in done])
                self._publish([b for b in batch if isinstance(b, BlockEvent)])
        except Exception:
            # Only events get here (their publishing failed): the writes were counted already.
            logger.exception("KV tier writer failed publishing block events; dropped")
        finally:
            with self._changed:
                if self._batch is batch:
                    self._forget(batch)
                    self._batch = None
                    self._changed.notify_all()

    def _remember_refused(self, hashes: list[bytes], reason: str) -> None:
        """Under ``_lock``: the server refused these writes for a passing ``reason``; a new round
        (none remembered) is tried again after the back-off, which doubles for the next one."""
        if not (self._refused_hashes or self._refused_overflow):
            wait = self._refused_backoff
            self._refused_retry_at = time.monotonic() + wait
            self._refused_backoff = min(REFUSED_RETRY_MAX_S, wait * 2)
            self._refusal_log.warning(
                "KV tier refuses block writes (%s); the blocks refused are written again in %.1fs "
                "if it takes them then",
                reason,
                wait,
            )
        for h in hashes:
            if len(self._refused_hashes) >= MAX_DROPPED_REMEMBERED:
                self._refused_overflow = True
                break
            self._refused_hashes[h] = None

    def _write(self, writes: list[BlockWrite]) -> tuple[list[BlockWrite], list[BlockWrite], str | None]:
        """Encode and write a batch: the writes the tier acknowledged, those that encoded, and the
        reason the server gave if it refused writes (``take_refused``). The others are dropped (a
        write the tier refused or lost); the caller counts each block once."""
        items: list[tuple[str, bytes]] = []
        encoded: list[BlockWrite] = []
        for w in writes:
            fingerprint = w.fingerprint or self.fingerprint
            try:
                value = codec.encode(w.block_hash, w.tensor, fingerprint=fingerprint)
            except Exception:
                logger.exception("KV block %s could not be encoded; dropped", w.block_hash.hex())
                continue
            items.append((tier_key(fingerprint, w.block_hash), value))
            encoded.append(w)
        take_refused()  # only this write's refusal counts
        try:
            stored = self.tier.put_many(items) if items else []
        except Exception:  # open_tier's tiers never raise; this thread must not lose count either
            logger.exception("KV tier write of %d blocks failed; dropped", len(items))
            stored = [False] * len(items)
        refusal = take_refused()
        done = [w for w, ok in zip(encoded, stored, strict=True) if ok]
        return done, encoded, refusal

    def _publish(self, events: list[BlockEvent]) -> None:
        assert self.publisher is not None
        with self._lock:
            missed, self._missed_events = self._missed_events, Counter()
        for fingerprint, n in missed.items():
            self.publisher.skip(n, fingerprint)
        i = 0
        while i < len(events):
            first = events[i]
            kind = first.kind
            hashes: list[bytes] = []
            while i < len(events) and _same_entry(events[i], first) and kind != "cleared":
                hashes.extend(events[i].hashes)
                i += 1
            if kind == "cleared":
                i += 1
            self.publisher.publish(kind, hashes, medium=first.medium, fingerprint=first.fingerprint)


def _same_entry(a: BlockEvent, b: BlockEvent) -> bool:
    """Whether two events coalesce into one stream entry."""
    return (a.kind, a.medium, a.fingerprint) == (b.kind, b.medium, b.fingerprint)
