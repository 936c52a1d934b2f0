"""The background writer of the KV connector: a bounded queue of block writes and events.

The engine thread hands over host snapshots of blocks; one daemon thread encodes them and
writes them in batches. The bound is on *pending* items (queued or being written), reserved
before the caller takes a snapshot, so a full queue costs the caller nothing and never blocks:
the write is dropped and counted in ``ferry:kv_tier_dropped_writes_total``. Writes that the
tier refuses or loses (Redis down, even mid-write; a full Redis; a memory bound) are counted there
too, block by block: every block handed over ends as exactly one of ``written`` or ``dropped``.
Events ride the same queue, after the writes they describe, and consecutive events of one kind
are coalesced into one stream entry.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvcache import codec
from kvcache.keys import tier_key
from kvcache.metrics import KV_TIER_DROPPED_WRITES
from kvcache.tier import Tier

if TYPE_CHECKING:
    from kvcache.events import KVEventPublisher

logger = logging.getLogger(__name__)

WRITE_BATCH = 32  # blocks per tier write


@dataclass(frozen=True)
class BlockWrite:
    block_hash: bytes
    tensor: torch.Tensor  # host snapshot of one block
    # The model fingerprint the block was computed under (None: the writer's): a write queued
    # before a weight update still lands under the old weights' key.
    fingerprint: str | None = None


@dataclass(frozen=True)
class BlockEvent:
    kind: str
    hashes: tuple[bytes, ...]
    medium: str


_STOP = object()


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
        # Unbounded by itself: ``_pending`` is the bound, so nothing ever blocks on the queue,
        # including close()'s stop marker.
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._pending = 0
        self._pending_hashes: Counter[bytes] = Counter()
        self._closed = False
        self.written = 0
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="kv-tier-write", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        with self._lock:
            return self._pending

    def reserve(self, n: int) -> int:
        """Reserve up to ``n`` slots; returns how many (the caller drops the rest via ``drop``)."""
        with self._lock:
            got = 0 if self._closed else min(n, max(0, self.capacity - self._pending))
            self._pending += got
            return got

    def submit(self, writes: Sequence[BlockWrite]) -> None:
        """Queue writes for slots already reserved (one slot each)."""
        with self._lock:
            self._pending_hashes.update(w.block_hash for w in writes)
        for w in writes:
            self._queue.put(w)

    def submit_event(self, event: BlockEvent) -> bool:
        if self.publisher is None or self.reserve(1) == 0:
            return False
        self._queue.put(event)
        return True

    def cancel(self, n: int) -> None:
        """Give back ``n`` reserved slots whose writes will never be submitted; they count as dropped."""
        with self._changed:
            self._pending -= n
            self._changed.notify_all()
        self.drop(n)

    def drop(self, n: int) -> None:
        KV_TIER_DROPPED_WRITES.inc(n)
        with self._lock:
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
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.flush(timeout)
        self._queue.put(_STOP)
        self._thread.join(timeout)

    def _run(self) -> None:
        if "parallel backend: OpenMP" in torch.__config__.parallel_info():
            torch.set_num_threads(1)  # per-thread under OpenMP: encoding never competes with the model
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            batch = [item]
            while len(batch) < WRITE_BATCH:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is _STOP:
                    self._queue.put(_STOP)  # handled after this batch
                    break
                batch.append(nxt)
            self._process(batch)

    def _process(self, batch: list[object]) -> None:
        writes = [b for b in batch if isinstance(b, BlockWrite)]
        try:
            if writes:
                self._write(writes)  # counts every write exactly once, written or dropped
            if self.publisher is not None:
                self._publish([b for b in batch if isinstance(b, BlockEvent)])
        except Exception:
            # Only events get here (their publishing failed): the writes were counted already.
            logger.exception("KV tier writer failed publishing block events; dropped")
        finally:
            with self._changed:
                self._pending -= len(batch)
                self._pending_hashes.subtract(w.block_hash for w in writes)
                for w in writes:
                    if self._pending_hashes[w.block_hash] <= 0:
                        del self._pending_hashes[w.block_hash]
                self._changed.notify_all()

    def _write(self, writes: list[BlockWrite]) -> None:
        """Encode and write a batch; each block counts once: ``written`` if the tier acknowledged it,
        else dropped (a block that does not encode, a write the tier refused or lost)."""
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
        try:
            stored = self.tier.put_many(items) if items else []
        except Exception:  # open_tier's tiers never raise; this thread must not lose count either
            logger.exception("KV tier write of %d blocks failed; dropped", len(items))
            stored = [False] * len(items)
        done = [w.block_hash for w, ok in zip(encoded, stored, strict=True) if ok]
        with self._lock:
            self.written += len(done)
        if len(done) < len(writes):
            self.drop(len(writes) - len(done))
        if self.publisher is not None and done:
            # Only the blocks the tier holds: a router that routes by these events must not send a
            # request to blocks that were never written.
            self.publisher.publish("stored", done, medium="tier")

    def _publish(self, events: list[BlockEvent]) -> None:
        assert self.publisher is not None
        i = 0
        while i < len(events):
            kind, medium = events[i].kind, events[i].medium
            hashes: list[bytes] = []
            while (
                i < len(events) and (events[i].kind, events[i].medium) == (kind, medium) and kind != "cleared"
            ):
                hashes.extend(events[i].hashes)
                i += 1
            if kind == "cleared":
                i += 1
            self.publisher.publish(kind, hashes, medium=medium)
