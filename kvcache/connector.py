"""The engine-side KV connector: moves whole KV blocks between the paged cache and the tier.

Owned by the engine process; engine-agnostic (it sees only block hashes, block ids and the
per-layer cache tensors of ARCHITECTURE.md, ``[num_blocks, block_size, num_kv_heads, head_dim]``).
A model caches two parts per layer (K and V) or one (MLA's latent, passed as the K caches with
no V caches); the block shape's second dim says which.

* ``lookup`` / ``lookup_async`` / ``load`` / ``load_async``: the read path, inherited from
  ``TierReads`` (``kvcache/tier_reads.py``): how many leading blocks the tier holds; fetch, verify
  and copy in the leading blocks it holds.
* ``save(hash, block_id, ...)`` / ``save_many``: snapshot the block to host memory *now*, on
  the caller's thread (the cache slot may be reused right after), and queue the write for a
  background writer. A full queue drops the write and counts it; saving never blocks. The writer
  remembers what it dropped so (bounded) for the re-publication pass: ``has_dropped_writes`` /
  ``take_dropped_writes``.
* ``republish(hashes, block_ids, ...)``: the same for blocks written again after the tier came
  back (``kvcache/republish.py``), in writer slots only while half the queue is still free: what
  finds no slot is left to the caller (not dropped), and blocks that fill meanwhile keep room.

The tensor copies both ways are ``kvcache/block_copy.py``'s. Nothing here raises on tier trouble:
a dead Redis means misses and dropped writes, counted in ``ferry:kv_tier_*`` metrics. Exceptions
are only for misuse (mismatched lengths, wrong dtype).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvcache.block_copy import BlockCopier
from kvcache.metrics import TierStats
from kvcache.tier import TierURL, open_tier
from kvcache.tier_presence import TierPresence
from kvcache.tier_reads import TierReads
from kvcache.writer import BlockEvent, BlockWrite, BlockWriter

if TYPE_CHECKING:
    from kvcache.engine_adapter import TierConnector
    from kvcache.events import KVEventPublisher


@dataclass(frozen=True)
class ConnectorStats:
    blocks_looked_up: int
    blocks_loaded: int
    load_seconds: float  # wall time spent in load() (fetch + verify + copy), all calls
    blocks_saved: int
    writes_dropped: int
    blocks_republished: int  # of blocks_saved: written again after the tier came back
    corrupt_blocks: int  # refused as damaged (codec: kind "corrupt")
    mismatched_blocks: int  # refused as another model's, layout's or format's (kind "mismatch")
    pending_writes: int  # handed to the writer, not yet counted saved or dropped (one snapshot)
    tier: TierStats


class KVConnector(TierReads):
    """See the module docstring. Thread-safe; one per engine process (per TP rank)."""

    def __init__(
        self,
        tier_url: str,
        fingerprint: str,
        block_shape: Sequence[int],
        dtype: torch.dtype,
        write_queue: int = 256,
        *,
        load_threads: int = 1,
        events: bool = False,
        events_url: str | None = None,
        replica_id: str | None = None,
        instance_id: str | None = None,
    ) -> None:
        copier = BlockCopier(block_shape, dtype)  # refuses a bad block_shape
        if write_queue < 1:
            raise ValueError("write_queue must be >= 1")
        self.block_shape = copier.block_shape
        self.dtype = dtype
        self.block_bytes = copier.block_bytes
        tier = open_tier(tier_url)
        try:
            publisher = self._open_publisher(
                tier_url, events, events_url, fingerprint, replica_id, instance_id
            )
        except Exception:
            tier.close()
            raise
        self._writer = BlockWriter(tier, fingerprint, write_queue, publisher)
        super().__init__(tier, copier, fingerprint, load_threads)
        if publisher is not None:
            # Stored tier events go out; so do removed ones, for the blocks reads find gone.
            self.presence = self._writer.presence = TierPresence()

    # ---- saves -------------------------------------------------------------------------------

    def save(
        self,
        block_hash: bytes,
        block_id: int,
        k_caches: Sequence[torch.Tensor],
        v_caches: Sequence[torch.Tensor],
    ) -> bool:
        """Snapshot one block and queue its write; ``False`` if dropped (queue full or closed)."""
        return self.save_many([block_hash], [block_id], k_caches, v_caches) == 1

    def save_many(
        self,
        hashes: Sequence[bytes],
        block_ids: Sequence[int],
        k_caches: Sequence[torch.Tensor],
        v_caches: Sequence[torch.Tensor],
    ) -> int:
        """Snapshot blocks and queue their writes; returns how many were queued (rest dropped)."""
        return self._queue_writes(hashes, block_ids, k_caches, v_caches, republish=False)

    def republish(
        self,
        hashes: Sequence[bytes],
        block_ids: Sequence[int],
        k_caches: Sequence[torch.Tensor],
        v_caches: Sequence[torch.Tensor],
    ) -> int:
        """``save_many`` for a re-publication: queues the leading blocks that fit in the writer's
        spare half and returns how many; the rest are neither snapshotted nor counted dropped."""
        return self._queue_writes(hashes, block_ids, k_caches, v_caches, republish=True)

    @property
    def has_dropped_writes(self) -> bool:
        """Writes were dropped for a full queue since the last ``take_dropped_writes`` (no I/O, no lock)."""
        return self._writer.has_dropped

    def take_dropped_writes(self, due_only: bool = False) -> tuple[list[bytes], bool]:
        """The hashes dropped for a full queue since the last call, then those the server refused for
        a passing reason (with ``due_only``, only once their back-off passed; oldest first), and
        whether more were dropped than the writer remembers; forgets them."""
        return self._writer.take_dropped(due_only)

    def writes_pending(self) -> bool:
        """Whether writes handed to the writer wait for their answer (no I/O)."""
        return self._writer.pending > 0

    def refused_retry_in(self) -> float | None:
        """Seconds until the writes the server refused are due to be written again (0: now), None
        with none (no I/O)."""
        return self._writer.retry_due_in()

    def write_mark(self) -> int:
        """A mark for ``write_covers``: the writer's acknowledged writes so far."""
        return self._writer.ack_mark()

    def write_covers(self, block_hash: bytes, mark: int) -> bool:
        """This connector's writer holds a write of ``block_hash``, or wrote it after ``mark``."""
        return self._writer.covers(block_hash, mark)

    def can_republish(self) -> bool:
        """Whether ``republish`` would find a writer slot now (the queue has room again)."""
        return self._writer.free_slots(keep_free=self._writer.capacity // 2) > 0

    def _queue_writes(
        self,
        hashes: Sequence[bytes],
        block_ids: Sequence[int],
        k_caches: Sequence[torch.Tensor],
        v_caches: Sequence[torch.Tensor],
        *,
        republish: bool,
    ) -> int:
        """Reserve writer slots for the leading blocks, snapshot those and queue their writes.

        Slots are taken before copying, so what finds none costs no snapshot. A save drops and
        counts what finds none; a re-publication leaves half the queue to the blocks that fill
        meanwhile and leaves what finds none to its caller, uncounted.
        """
        if len(hashes) != len(block_ids):
            raise ValueError(f"{len(hashes)} hashes but {len(block_ids)} block ids")
        if not hashes:
            return 0
        self.copier.check(k_caches, v_caches)
        if republish:
            n = self._writer.reserve(len(hashes), keep_free=self._writer.capacity // 2)
        else:
            n = self._writer.reserve(len(hashes))
            if n < len(hashes):
                self._writer.drop(hashes[n:])
        if n == 0:
            return 0
        try:
            snapshot = self.copier.snapshot(block_ids[:n], k_caches, v_caches)
        except BaseException:
            self._writer.cancel(n)  # the slots come back and the blocks count as dropped
            raise
        fp = self.fingerprint
        writes = [BlockWrite(bytes(hashes[i]), snapshot[i], fp, republish=republish) for i in range(n)]
        self._writer.submit(writes)
        return n

    def flush(self, timeout: float | None = None, hashes: Sequence[bytes] | None = None) -> bool:
        """Wait until every queued write (or only those of ``hashes``) was attempted; ``False`` on timeout."""
        return self._writer.flush(timeout, hashes)

    def set_fingerprint(self, fingerprint: str) -> None:
        """The model's weights changed: look up, load and write blocks under ``fingerprint`` from
        now on. What was queued before keeps the old one, however long the tier takes to write it:
        its writes land under the old key, its events (and those of its writes) go to the old
        model's stream, so a router never reads the old weights' blocks as the new ones'."""
        self.fingerprint = self._writer.fingerprint = fingerprint
        if self._writer.publisher is not None:
            from kvcache.events import events_stream

            self._writer.publisher.stream = events_stream(fingerprint)

    # ---- events ------------------------------------------------------------------------------

    def _write_pending(self, block_hash: bytes) -> bool:
        return self._writer.is_pending(block_hash)

    def _report_lost(self, blocks: list[tuple[str, bytes]]) -> None:
        """Blocks this replica saw the tier hold and a read found gone (evicted, expired, deleted):
        a ``removed`` tier event each (one entry per model), after the writes queued before it."""
        by_fingerprint: dict[str, list[bytes]] = {}
        for fingerprint, block_hash in blocks:
            by_fingerprint.setdefault(fingerprint, []).append(block_hash)
        for fingerprint, hashes in by_fingerprint.items():
            self._writer.submit_event(BlockEvent("removed", tuple(hashes), "tier", fingerprint))

    def report_absent(self, hashes: Sequence[bytes], since: int) -> None:
        """A check that started at presence generation ``since`` found ``hashes`` absent (the
        re-publication pass's): report those this replica had seen held."""
        if self.presence is not None and hashes:
            gone = self.presence.lost(self.keys(hashes), since, self._write_pending)
            if gone:
                self._report_lost(gone)

    @property
    def events_enabled(self) -> bool:
        return self._writer.publisher is not None

    def publish_event(self, kind: str, hashes: Sequence[bytes], medium: str = "device") -> bool:
        """Queue a block event (``stored``/``removed``/``cleared``, by default about the device cache).

        ``False`` when events are off or the writer closed, or when even the events' headroom in
        the write queue is full: then the event is missed and the stream shows readers the gap
        (``BlockWriter.submit_event``).
        """
        return self._writer.submit_event(BlockEvent(kind, tuple(hashes), medium, self.fingerprint))

    @staticmethod
    def _open_publisher(
        tier_url: str,
        events: bool,
        events_url: str | None,
        fingerprint: str,
        replica_id: str | None,
        instance_id: str | None,
    ) -> KVEventPublisher | None:
        if not events:
            return None
        from kvcache.events import KVEventPublisher

        if events_url is None:
            parsed = TierURL(tier_url)
            if parsed.scheme not in ("redis", "rediss"):
                raise ValueError("KV events need a Redis: use a redis:// tier or pass events_url")
            from kvcache.redis_tier import client_url

            events_url = client_url(tier_url)  # the tier's TLS and client_name settings kept
        return KVEventPublisher(events_url, fingerprint, replica_id, instance_id=instance_id)

    # ---- lifecycle ----------------------------------------------------------------------------

    def stats(self) -> ConnectorStats:
        tier = self.tier.stats()
        w = self._writer.counts()
        with self._lock:
            return ConnectorStats(
                blocks_looked_up=self._looked_up,
                blocks_loaded=self._loaded,
                load_seconds=self._load_seconds,
                blocks_saved=w.written,
                writes_dropped=w.dropped,
                blocks_republished=w.republished,
                corrupt_blocks=self._corrupt,
                mismatched_blocks=self._mismatched,
                pending_writes=w.pending,
                tier=tier,
            )

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued (up to ``timeout``), stop the threads, close the tier."""
        if not self._stop_reads():  # every lookup and load answers 0 from here on
            return
        self._writer.close(timeout)
        self._end_reads(timeout)
        self.tier.close()
        if self._writer.publisher is not None:
            self._writer.publisher.close()

    def __enter__(self) -> KVConnector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def create_connector(config: Any, engine: Any) -> TierConnector:
    """The engine's tier connector (``engine.kv_connector.build_kv_connector`` calls this)."""
    from kvcache.engine_adapter import TierConnector

    return TierConnector(config, engine)
