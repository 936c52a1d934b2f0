"""The engine-side KV connector: moves whole KV blocks between the paged cache and the tier.

Owned by the engine process; engine-agnostic (it sees only block hashes, block ids and the
per-layer cache tensors of ARCHITECTURE.md, ``[num_blocks, block_size, num_kv_heads, head_dim]``).
A model caches two parts per layer (K and V) or one (MLA's latent, passed as the K caches with
no V caches); the block shape's second dim says which.

* ``lookup(hashes)``: how many leading blocks the tier holds (one cheap round trip).
  ``lookup_async`` answers on a lookup thread, batching the lookups queued meanwhile into one
  call (one round trip on Redis): the engine starts one when a request arrives.
* ``load(hashes, block_ids, k_caches, v_caches)``: fetch, verify and copy into the given
  blocks; returns how many *leading* blocks landed (stops at the first miss, corrupt value or
  value whose header names another model fingerprint, dtype or shape than this connector's).
  ``load_async`` runs the same on a loader thread and returns a ``Future[int]``, so a request
  waiting on tier I/O never stalls other requests' steps.
* ``save(hash, block_id, ...)`` / ``save_many``: snapshot the block to host memory *now*, on
  the caller's thread (the cache slot may be reused right after), and queue the write for a
  background writer. A full queue drops the write and counts it; saving never blocks.
* ``republish(hashes, block_ids, ...)``: the same for blocks written again after the tier came
  back (``kvcache/republish.py``), in writer slots only while half the queue is still free: what
  finds no slot is left to the caller (not dropped), and blocks that fill meanwhile keep room.

Nothing here raises on tier trouble: a dead Redis means misses and dropped writes, counted in
``ferry:kv_tier_*`` metrics. Exceptions are only for misuse (mismatched lengths, wrong dtype).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from engine.torch_threads import set_this_thread_count, this_thread_count
from kvcache import codec
from kvcache.keys import tier_key
from kvcache.metrics import ERROR_MISMATCH, TierStats
from kvcache.tier import TierURL, open_tier
from kvcache.writer import BlockEvent, BlockWrite, BlockWriter

if TYPE_CHECKING:
    from kvcache.engine_adapter import TierConnector
    from kvcache.events import KVEventPublisher

logger = logging.getLogger(__name__)

LOAD_CHUNK = 64  # blocks per tier read: long prefixes stream in chunks and stop at a miss early
LOOKUP_BATCH = 256  # admission lookups answered by one tier call (one Redis round trip)
STAGING_BYTES = 32 << 20  # cap of one thread's host staging buffer (bounds LOAD_CHUNK for big blocks)

# The connector's tensor work is memcpy-shaped: one thread already outruns the network, while an
# OpenMP team competing with the model's own team (or other processes) stalls on every op (10x
# slower measured on a loaded 2-core box). With the OpenMP backend the thread count is a
# per-thread setting, so it can be lowered for the connector's work alone (engine/torch_threads.py).


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
        instance_id: str | None = None,
    ) -> None:
        shape = tuple(int(d) for d in block_shape)
        if len(shape) != 5 or shape[1] not in (1, 2) or min(shape) <= 0:
            raise ValueError(
                "block_shape must be (num_layers, parts, block_size, num_kv_heads, head_dim) with 2 parts "
                f"(K, V) or 1 (a latent), got {block_shape}"
            )
        if write_queue < 1:
            raise ValueError("write_queue must be >= 1")
        self.fingerprint = fingerprint
        self.block_shape = shape
        self.dtype = dtype
        self.num_layers = shape[0]
        self.num_parts = shape[1]
        self.tier = open_tier(tier_url)
        try:
            publisher = self._open_publisher(
                tier_url, events, events_url, fingerprint, replica_id, instance_id
            )
        except Exception:
            self.tier.close()
            raise
        self._writer = BlockWriter(self.tier, fingerprint, write_queue, publisher)
        self._lock = threading.Lock()
        self._looked_up = self._loaded = self._corrupt = self._mismatched = 0
        self._load_seconds = 0.0
        self._closed = False
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._local = threading.local()
        self.block_bytes = math.prod(shape) * dtype.itemsize
        self.load_chunk = max(1, min(LOAD_CHUNK, STAGING_BYTES // self.block_bytes))
        self._loader = ThreadPoolExecutor(
            max_workers=load_threads,
            thread_name_prefix="kv-tier-load",
            initializer=partial(set_this_thread_count, 1),
        )
        # Admission lookups (lookup_async): (keys, future) items, None to stop; started on first use.
        self._lookups: queue.SimpleQueue[tuple[list[str], Future[int]] | None] = queue.SimpleQueue()
        self._lookup_thread: threading.Thread | None = None

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

    def lookup_async(self, hashes: Sequence[bytes]) -> Future[int]:
        """``lookup`` on the lookup thread, which answers every lookup queued meanwhile in one
        batched call (one round trip on Redis), so admission never waits on the tier's latency."""
        if not hashes:
            done: Future[int] = Future()
            done.set_result(0)
            return done
        future: Future[int] = Future()
        keys = self.keys(hashes)
        with self._lock:
            if self._closed:
                future.set_result(0)
                return future
            if self._lookup_thread is None:
                self._lookup_thread = threading.Thread(
                    target=self._run_lookups, name="kv-tier-lookup", daemon=True
                )
                self._lookup_thread.start()
            self._lookups.put((keys, future))
        return future

    def _run_lookups(self) -> None:
        while True:
            batch = [self._lookups.get()]
            while len(batch) < LOOKUP_BATCH:
                try:
                    batch.append(self._lookups.get_nowait())
                except queue.Empty:
                    break
            stop = any(item is None for item in batch)
            batch = [item for item in batch if item is not None]
            counts = [0] * len(batch)
            if batch and not self._closed:
                try:
                    counts = self.tier.contains_prefix_many([keys for keys, _ in batch])
                except Exception:  # the tier never raises; this thread must never die either
                    logger.exception("KV tier lookups failed; treated as misses")
            with self._lock:
                self._looked_up += sum(len(keys) for keys, _ in batch)
            for (_, future), n in zip(batch, counts, strict=True):
                future.set_result(n)
            if stop:
                return

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
        started = time.perf_counter()
        loaded = 0
        # One fingerprint for the whole load: the keys read and the headers checked name the same
        # model even if a weight update changes the connector's fingerprint meanwhile.
        fingerprint = self.fingerprint
        for start in range(0, len(hashes), self.load_chunk):
            if self._closed:
                break
            chunk = hashes[start : start + self.load_chunk]
            values = self.tier.fetch([tier_key(fingerprint, h) for h in chunk])
            blocks: list[torch.Tensor] = []
            for block_hash, value in zip(chunk, values, strict=True):
                if value is None:
                    break
                tensor, reason = codec.decode_with_reason(
                    block_hash, value, self.dtype, self.block_shape, fingerprint=fingerprint
                )
                if tensor is None:
                    kind = codec.record_rejection(block_hash, reason or codec.INTERNAL)
                    with self._lock:
                        if kind == ERROR_MISMATCH:
                            self._mismatched += 1
                        else:
                            self._corrupt += 1
                    break
                blocks.append(tensor)
            if blocks:
                with this_thread_count(1):
                    self._copy_in(blocks, block_ids[start : start + len(blocks)], k_caches, v_caches)
                loaded += len(blocks)
            if len(blocks) < len(chunk):
                break
        # A hit is a block that landed: not one found corrupt, nor one read past a miss and unused.
        self.tier.count_blocks(loaded, len(hashes) - loaded)
        with self._lock:
            self._loaded += loaded
            self._load_seconds += time.perf_counter() - started
        return loaded

    def load_async(
        self,
        hashes: Sequence[bytes],
        block_ids: Sequence[int],
        k_caches: Sequence[torch.Tensor],
        v_caches: Sequence[torch.Tensor],
        then: Callable[[int], None] | None = None,
    ) -> Future[int]:
        """``load`` on a loader thread. The caller must not touch ``block_ids`` until it is done.

        ``then(loaded)`` runs on the loader thread before the future completes, so whatever it
        records is visible to anyone who saw the future done.
        """
        if len(hashes) != len(block_ids):
            raise ValueError(f"{len(hashes)} hashes but {len(block_ids)} block ids")
        self._check_caches(k_caches, v_caches)
        hashes, block_ids = list(hashes), list(block_ids)

        def run() -> int:
            loaded = self.load(hashes, block_ids, k_caches, v_caches)
            if then is not None:
                then(loaded)
            return loaded

        with self._lock:
            if not self._closed:
                return self._loader.submit(run)
        done: Future[int] = Future()
        done.set_result(0)  # closed: nothing loads, the caller recomputes
        return done

    def _copy_in(
        self,
        blocks: list[torch.Tensor],
        block_ids: Sequence[int],
        k_caches: Sequence[torch.Tensor],
        v_caches: Sequence[torch.Tensor],
    ) -> None:
        device = k_caches[0].device
        on_gpu = device.type == "cuda"
        # One copy into a reused host staging buffer (fresh buffers cost page faults that take
        # longer than the copy itself), then 2 x num_layers index_copy_ calls for the whole chunk
        # instead of 2 x num_layers per block.
        staging = self._staging_buffer(len(blocks), pinned=on_gpu)
        torch.stack(blocks, out=staging)  # [n, layers, 2, block_size, kv_heads, head_dim]
        if on_gpu:
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
            with torch.cuda.stream(stream):
                self._scatter(staging.to(device, non_blocking=True), block_ids, k_caches, v_caches)
            stream.synchronize()  # blocks usable by any stream once load() returns; staging reusable
        else:
            self._scatter(staging, block_ids, k_caches, v_caches)

    def _staging_buffer(self, n: int, *, pinned: bool) -> torch.Tensor:
        """A per-thread host buffer of ``load_chunk`` blocks (load and load_async may overlap)."""
        buf = getattr(self._local, "staging", None)
        if buf is None:
            buf = torch.empty((self.load_chunk, *self.block_shape), dtype=self.dtype, pin_memory=pinned)
            self._local.staging = buf
        return buf[:n]

    def _scatter(
        self,
        staging: torch.Tensor,
        block_ids: Sequence[int],
        k_caches: Sequence[torch.Tensor],
        v_caches: Sequence[torch.Tensor],
    ) -> None:
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=staging.device)
        for layer in range(self.num_layers):
            for part, cache in enumerate(self._parts(layer, k_caches, v_caches)):
                cache.index_copy_(0, ids, staging[:, layer, part])

    def _parts(
        self, layer: int, k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
        return (k_caches[layer],) if self.num_parts == 1 else (k_caches[layer], v_caches[layer])

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
        n = self._writer.reserve(len(hashes))  # before copying: a full queue costs no snapshot
        if n < len(hashes):
            self._writer.drop(len(hashes) - n)
        if n == 0:
            return 0
        try:
            with this_thread_count(1):
                snapshot = self._snapshot(block_ids[:n], k_caches, v_caches)
        except BaseException:
            self._writer.cancel(n)  # the slots come back and the blocks count as dropped
            raise
        fp = self.fingerprint
        self._writer.submit([BlockWrite(bytes(hashes[i]), snapshot[i], fp) for i in range(n)])
        return n

    def republish(
        self,
        hashes: Sequence[bytes],
        block_ids: Sequence[int],
        k_caches: Sequence[torch.Tensor],
        v_caches: Sequence[torch.Tensor],
    ) -> int:
        """``save_many`` for a re-publication: queues the leading blocks that fit in the writer's
        spare half and returns how many; the rest are neither snapshotted nor counted dropped."""
        if len(hashes) != len(block_ids):
            raise ValueError(f"{len(hashes)} hashes but {len(block_ids)} block ids")
        if not hashes:
            return 0
        self._check_caches(k_caches, v_caches)
        n = self._writer.reserve(len(hashes), keep_free=self._writer.capacity // 2)
        if n == 0:
            return 0
        try:
            with this_thread_count(1):
                snapshot = self._snapshot(block_ids[:n], k_caches, v_caches)
        except BaseException:
            self._writer.cancel(n)
            raise
        fp = self.fingerprint
        self._writer.submit([BlockWrite(bytes(hashes[i]), snapshot[i], fp, republish=True) for i in range(n)])
        return n

    def _snapshot(
        self, block_ids: Sequence[int], k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        """``[n, *block_shape]`` host copy of the blocks (synchronous: a slot may be reused right after)."""
        if len(block_ids) == 1:  # the common per-block case: views and a single stack
            b = block_ids[0]
            parts = [t[b] for layer in range(self.num_layers) for t in self._parts(layer, k_caches, v_caches)]
            return torch.stack(parts).view(1, *self.block_shape).to("cpu")
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=k_caches[0].device)
        out = torch.empty((len(block_ids), *self.block_shape), dtype=self.dtype, device=k_caches[0].device)
        for layer in range(self.num_layers):
            for part, cache in enumerate(self._parts(layer, k_caches, v_caches)):
                out[:, layer, part].copy_(cache.index_select(0, ids))
        return out.to("cpu")

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

    @property
    def events_enabled(self) -> bool:
        return self._writer.publisher is not None

    def publish_event(self, kind: str, hashes: Sequence[bytes], medium: str = "device") -> bool:
        """Queue a block event (``stored``/``removed``/``cleared``, by default about the device cache).

        A no-op returning ``False`` when events are off or the queue is full (events are hints).
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

    # ---- lifecycle ---------------------------------------------------------------------------

    def _check_caches(self, k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor]) -> None:
        num_v = self.num_layers if self.num_parts == 2 else 0
        if len(k_caches) != self.num_layers or len(v_caches) != num_v:
            raise ValueError(
                f"expected {self.num_layers} K and {num_v} V caches, got {len(k_caches)} and {len(v_caches)}"
            )
        k = k_caches[0]
        if k.dtype != self.dtype or tuple(k.shape[1:]) != self.block_shape[2:]:
            raise ValueError(
                f"cache layout {tuple(k.shape[1:])}/{k.dtype} does not match the connector's "
                f"{self.block_shape[2:]}/{self.dtype}"
            )

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
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._writer.close(timeout)
        self._loader.shutdown(wait=True, cancel_futures=True)
        if self._lookup_thread is not None:
            self._lookups.put(None)  # answers what is queued (misses: closed), then stops
            self._lookup_thread.join(timeout)
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
