"""The engine-side KV connector: moves whole KV blocks between the paged cache and the tier.

Owned by the engine process; engine-agnostic (it sees only block hashes, block ids and the
per-layer cache tensors of ARCHITECTURE.md, ``[num_blocks, block_size, num_kv_heads, head_dim]``).

* ``lookup(hashes)``: how many leading blocks the tier holds (one cheap round trip).
* ``load(hashes, block_ids, k_caches, v_caches)``: fetch, verify and copy into the given
  blocks; returns how many *leading* blocks landed (stops at the first miss or corrupt
  value). ``load_async`` runs the same on a loader thread and returns a ``Future[int]``, so a
  request waiting on tier I/O never stalls other requests' steps.
* ``save(hash, block_id, ...)`` / ``save_many``: snapshot the block to host memory *now*, on
  the caller's thread (the cache slot may be reused right after), and queue the write for a
  background writer. A full queue drops the write and counts it; saving never blocks.

Nothing here raises on tier trouble: a dead Redis means misses and dropped writes, counted in
``ferry:kv_tier_*`` metrics. Exceptions are only for misuse (mismatched lengths, wrong dtype).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvcache import codec
from kvcache.keys import tier_key
from kvcache.metrics import KV_TIER_DROPPED_WRITES, TierStats
from kvcache.tier import TierURL, open_tier

if TYPE_CHECKING:
    from kvcache.events import KVEventPublisher

logger = logging.getLogger(__name__)

LOAD_CHUNK = 64  # blocks per tier read: long prefixes stream in chunks and stop at a miss early
WRITE_BATCH = 32  # blocks per tier write from the background writer


@dataclass(frozen=True)
class ConnectorStats:
    blocks_looked_up: int
    blocks_loaded: int
    blocks_saved: int
    writes_dropped: int
    corrupt_blocks: int
    pending_writes: int
    tier: TierStats


@dataclass(frozen=True)
class _Write:
    block_hash: bytes
    tensor: torch.Tensor  # host snapshot, shape = block_shape


@dataclass(frozen=True)
class _Event:
    kind: str
    hashes: tuple[bytes, ...]
    medium: str


_STOP = object()


class KVConnector:
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
    ) -> None:
        shape = tuple(int(d) for d in block_shape)
        if len(shape) != 5 or shape[1] != 2 or min(shape) <= 0:
            raise ValueError(
                f"block_shape must be (num_layers, 2, block_size, num_kv_heads, head_dim), got {block_shape}"
            )
        if write_queue < 1:
            raise ValueError("write_queue must be >= 1")
        self.fingerprint = fingerprint
        self.block_shape = shape
        self.dtype = dtype
        self.num_layers = shape[0]
        self.tier = open_tier(tier_url)
        self._publisher = self._open_publisher(tier_url, events, events_url, fingerprint, replica_id)
        self.write_queue = write_queue
        # Unbounded by itself: ``_pending`` (reserved before a snapshot is taken) is the bound,
        # so nothing ever blocks on the queue, including close()'s stop marker.
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending = 0  # queued or being written
        self._looked_up = self._loaded = self._saved = self._dropped = self._corrupt = 0
        self._closed = False
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._loader = ThreadPoolExecutor(max_workers=load_threads, thread_name_prefix="kv-tier-load")
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-write", daemon=True)
        self._writer.start()

    # ---- lookups and loads -------------------------------------------------------------------

    def keys(self, hashes: Sequence[bytes]) -> list[str]:
        return [tier_key(self.fingerprint, h) for h in hashes]

    def lookup(self, hashes: Sequence[bytes]) -> int:
        """Number of leading blocks of ``hashes`` the tier holds (0 when the tier is down)."""
        if not hashes or self._closed:
            return 0
        n = self.tier.contains_prefix(self.keys(hashes))
        with self._lock:
            self._looked_up += len(hashes)
        return n

    def load(
        self,
        hashes: Sequence[bytes],
        block_ids: Sequence[int],
        k_caches: Sequence[torch.Tensor],
        v_caches: Sequence[torch.Tensor],
    ) -> int:
        """Copy the leading blocks the tier holds into ``block_ids``; returns how many landed.

        Blocks after the first miss or corrupt value are not touched, so the caller computes
        exactly ``hashes[returned:]``.
        """
        if len(hashes) != len(block_ids):
            raise ValueError(f"{len(hashes)} hashes but {len(block_ids)} block ids")
        self._check_caches(k_caches, v_caches)
        loaded = 0
        for start in range(0, len(hashes), LOAD_CHUNK):
            if self._closed:
                break
            chunk = hashes[start : start + LOAD_CHUNK]
            values = self.tier.get_many(self.keys(chunk))
            blocks: list[torch.Tensor] = []
            for block_hash, value in zip(chunk, values, strict=True):
                if value is None:
                    break
                tensor = codec.decode(block_hash, value, self.dtype, self.block_shape)
                if tensor is None:
                    with self._lock:
                        self._corrupt += 1
                    break
                blocks.append(tensor)
            if blocks:
                self._copy_in(blocks, block_ids[start : start + len(blocks)], k_caches, v_caches)
                loaded += len(blocks)
            if len(blocks) < len(chunk):
                break
        with self._lock:
            self._loaded += loaded
        return loaded

    def load_async(
        self,
        hashes: Sequence[bytes],
        block_ids: Sequence[int],
        k_caches: Sequence[torch.Tensor],
        v_caches: Sequence[torch.Tensor],
    ) -> Future[int]:
        """``load`` on a loader thread. The caller must not touch ``block_ids`` until it is done."""
        if len(hashes) != len(block_ids):
            raise ValueError(f"{len(hashes)} hashes but {len(block_ids)} block ids")
        self._check_caches(k_caches, v_caches)
        return self._loader.submit(self.load, list(hashes), list(block_ids), k_caches, v_caches)

    def _copy_in(
        self,
        blocks: list[torch.Tensor],
        block_ids: Sequence[int],
        k_caches: Sequence[torch.Tensor],
        v_caches: Sequence[torch.Tensor],
    ) -> None:
        device = k_caches[0].device
        # One host staging copy, then 2 x num_layers index_copy_ calls for the whole chunk
        # instead of 2 x num_layers per block.
        on_gpu = device.type == "cuda"
        staging = torch.empty((len(blocks), *self.block_shape), dtype=self.dtype, pin_memory=on_gpu)
        torch.stack(blocks, out=staging)  # [n, layers, 2, block_size, kv_heads, head_dim]
        if on_gpu:
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
            with torch.cuda.stream(stream):
                self._scatter(staging.to(device, non_blocking=True), block_ids, k_caches, v_caches)
            stream.synchronize()  # the blocks are usable by any stream once load() returns
        else:
            self._scatter(staging, block_ids, k_caches, v_caches)

    def _scatter(
        self,
        staging: torch.Tensor,
        block_ids: Sequence[int],
        k_caches: Sequence[torch.Tensor],
        v_caches: Sequence[torch.Tensor],
    ) -> None:
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=staging.device)
        for layer in range(self.num_layers):
            k_caches[layer].index_copy_(0, ids, staging[:, layer, 0])
            v_caches[layer].index_copy_(0, ids, staging[:, layer, 1])

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
        if len(hashes) != len(block_ids):
            raise ValueError(f"{len(hashes)} hashes but {len(block_ids)} block ids")
        if not hashes:
            return 0
        self._check_caches(k_caches, v_caches)
        with self._lock:
            room = 0 if self._closed else max(0, self.write_queue - self._pending)
            n = min(room, len(hashes))
            self._pending += n  # reserve before copying, so a full queue costs no snapshot
        if n < len(hashes):
            self._drop(len(hashes) - n)
        if n == 0:
            return 0
        snapshot = self._snapshot(block_ids[:n], k_caches, v_caches)
        for i in range(n):
            self._queue.put_nowait(_Write(bytes(hashes[i]), snapshot[i]))
        return n

    def _snapshot(
        self, block_ids: Sequence[int], k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        device = k_caches[0].device
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=device)
        out = torch.empty((len(block_ids), *self.block_shape), dtype=self.dtype, device=device)
        for layer in range(self.num_layers):
            out[:, layer, 0].copy_(k_caches[layer].index_select(0, ids))
            out[:, layer, 1].copy_(v_caches[layer].index_select(0, ids))
        return out.to("cpu")  # synchronous on CUDA: the block may be overwritten right after

    def _drop(self, n: int) -> None:
        KV_TIER_DROPPED_WRITES.inc(n)
        with self._lock:
            self._dropped += n

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write has been attempted; ``False`` on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._pending > 0:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._idle.wait(remaining)
        return True

    def _write_loop(self) -> None:
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
                    self._queue.put(_STOP)  # seen after this batch is written
                    break
                batch.append(nxt)
            self._write_batch(batch)

    def _write_batch(self, batch: list[object]) -> None:
        writes = [b for b in batch if isinstance(b, _Write)]
        try:
            if writes:
                items = [
                    (tier_key(self.fingerprint, w.block_hash), codec.encode(w.block_hash, w.tensor))
                    for w in writes
                ]
                if self.tier.put_many(items):
                    with self._lock:
                        self._saved += len(writes)
                    if self._publisher is not None:
                        self._publisher.publish("stored", [w.block_hash for w in writes], medium="tier")
                else:
                    self._drop(len(writes))
            if self._publisher is not None:
                for event in batch:
                    if isinstance(event, _Event):
                        self._publisher.publish(event.kind, event.hashes, medium=event.medium)
        except Exception:
            logger.exception("KV tier writer failed on a batch of %d; dropped", len(writes))
            self._drop(len(writes))
        finally:
            with self._idle:
                self._pending -= len(batch)
                if self._pending == 0:
                    self._idle.notify_all()

    # ---- events ------------------------------------------------------------------------------

    @property
    def events_enabled(self) -> bool:
        return self._publisher is not None

    def publish_event(self, kind: str, hashes: Sequence[bytes], medium: str = "device") -> bool:
        """Queue a block event (``stored``/``removed``/``cleared`` on the device cache) for the writer.

        A no-op returning ``False`` when events are off or the queue is full (events are hints).
        """
        if self._publisher is None:
            return False
        with self._lock:
            if self._closed or self._pending >= self.write_queue:
                return False
            self._pending += 1
        self._queue.put_nowait(_Event(kind, tuple(hashes), medium))
        return True

    @staticmethod
    def _open_publisher(
        tier_url: str, events: bool, events_url: str | None, fingerprint: str, replica_id: str | None
    ) -> KVEventPublisher | None:
        if not events:
            return None
        from kvcache.events import KVEventPublisher

        if events_url is None:
            parsed = TierURL(tier_url)
            if parsed.scheme not in ("redis", "rediss"):
                raise ValueError("KV events need a Redis: use a redis:// tier or pass events_url")
            events_url = parsed.url_without_params()
        return KVEventPublisher(events_url, fingerprint, replica_id)

    # ---- lifecycle ---------------------------------------------------------------------------

    def _check_caches(self, k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor]) -> None:
        if len(k_caches) != self.num_layers or len(v_caches) != self.num_layers:
            raise ValueError(
                f"expected {self.num_layers} K and V caches, got {len(k_caches)} and {len(v_caches)}"
            )
        k = k_caches[0]
        if k.dtype != self.dtype or tuple(k.shape[1:]) != self.block_shape[2:]:
            raise ValueError(
                f"cache layout {tuple(k.shape[1:])}/{k.dtype} does not match the connector's "
                f"{self.block_shape[2:]}/{self.dtype}"
            )

    def stats(self) -> ConnectorStats:
        tier = self.tier.stats()
        with self._lock:
            return ConnectorStats(
                blocks_looked_up=self._looked_up,
                blocks_loaded=self._loaded,
                blocks_saved=self._saved,
                writes_dropped=self._dropped,
                corrupt_blocks=self._corrupt,
                pending_writes=self._pending,
                tier=tier,
            )

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued (up to ``timeout``), stop the threads, close the tier."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.flush(timeout)
        self._queue.put(_STOP)
        self._writer.join(timeout)
        self._loader.shutdown(wait=True, cancel_futures=True)
        self.tier.close()
        if self._publisher is not None:
            self._publisher.close()

    def __enter__(self) -> KVConnector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
