"""The KV connector's read path: lookups and loads of whole blocks from the tier.

* ``lookup(hashes)``: how many leading blocks the tier holds (one cheap round trip).
  ``lookup_async`` answers on a lookup thread, batching the lookups queued meanwhile into one
  call (one round trip on Redis): the engine starts one when a request arrives.
* ``load(hashes, block_ids, k_caches, v_caches)``: fetch, verify and copy into the given
  blocks; returns how many *leading* blocks landed (stops at the first miss, corrupt value or
  value whose header names another model fingerprint, dtype or shape than this connector's).
  ``load_async`` runs the same on a loader thread and returns a ``Future[int]``, so a request
  waiting on tier I/O never stalls other requests' steps.

``TierReads`` is ``KVConnector``'s base (``kvcache/connector.py`` adds the writes, events and stats,
and reads the counters here under ``_lock``). Nothing here raises on tier trouble (a dead tier reads
as misses); exceptions are only for misuse.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

import torch

from engine.torch_threads import set_this_thread_count
from kvcache import codec
from kvcache.block_copy import BlockCopier
from kvcache.keys import KEY_PREFIX, tier_key
from kvcache.metrics import ERROR_MISMATCH
from kvcache.tier import Tier, answered, expect_answers
from kvcache.tier_presence import TierPresence

logger = logging.getLogger(__name__)

LOOKUP_BATCH = 256  # admission lookups answered by one tier call (one Redis round trip)


class TierReads:
    """See the module docstring. Thread-safe. ``fingerprint`` names the model whose blocks are read
    (``KVConnector.set_fingerprint`` changes it); ``_stop_reads`` then ``_end_reads`` end it."""

    def __init__(self, tier: Tier, copier: BlockCopier, fingerprint: str, load_threads: int) -> None:
        self.tier = tier
        self.copier = copier
        self.fingerprint = fingerprint
        self._lock = threading.Lock()
        self._looked_up = self._loaded = self._corrupt = self._mismatched = 0
        self._load_seconds = 0.0
        self._closed = False
        self._loader = ThreadPoolExecutor(
            max_workers=load_threads,
            thread_name_prefix="kv-tier-load",
            initializer=partial(set_this_thread_count, 1),
        )
        # Admission lookups (lookup_async): (keys, future) items, None to stop; started on first use.
        self._lookups: queue.SimpleQueue[tuple[list[str], Future[int]] | None] = queue.SimpleQueue()
        # What the reads saw the tier hold, for the ``removed`` tier events (``KVConnector``, events on).
        self.presence: TierPresence | None = None
        self._lookup_thread: threading.Thread | None = None

    def keys(self, hashes: Sequence[bytes]) -> list[str]:
        return [tier_key(self.fingerprint, h) for h in hashes]

    # ---- lookups -----------------------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes]) -> int:
        """Number of leading blocks of ``hashes`` the tier holds (0 when the tier is down)."""
        if not hashes or self._closed:
            return 0
        keys = self.keys(hashes)
        since = self._reading()
        n = self.tier.contains_prefix(keys)
        self._found(keys, n, since)
        with self._lock:
            self._looked_up += len(hashes)
        return n

    def lookup_shared(self, hashes: Sequence[bytes]) -> int:
        """``lookup`` as another process sees it: of a composite tier, what its shared level holds
        (its local level holds every block this process wrote, also those Redis refused or evicted
        since). For a producer's report: the consumer reads another process's tier."""
        if not hashes or self._closed:
            return 0
        keys = self.keys(hashes)
        since = self._reading()
        flags = self.tier.contains_many(keys)
        n = 0 if flags is None else next((i for i, held in enumerate(flags) if not held), len(flags))
        if flags is not None:
            self._found(keys, n, since)
        with self._lock:
            self._looked_up += len(hashes)
        return n

    # ---- what the reads saw (``TierPresence``) -----------------------------------------------

    def _reading(self) -> int:
        """Before a read (on its thread): the presence generation its findings are relative to."""
        if self.presence is None:
            return 0
        expect_answers()
        return self.presence.generation

    def _found(self, keys: Sequence[str], held: int, since: int) -> None:
        """A read found ``keys[:held]`` in the tier and ``keys[held]`` (if any) absent: note the
        first, and report the second removed if this replica had seen it held (``_report_lost``).
        A read the tier did not answer (down, an open breaker) found nothing either way."""
        presence = self.presence
        if presence is None or not answered():
            return
        if held:
            presence.saw((k, *_parse_key(k)) for k in keys[:held])
        if held < len(keys):
            gone = presence.lost([keys[held]], since, self._write_pending)
            if gone:
                self._report_lost(gone)

    def _write_pending(self, block_hash: bytes) -> bool:
        return False

    def _report_lost(self, blocks: list[tuple[str, bytes]]) -> None:
        return None

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
                since = self._reading()
                try:
                    counts = self.tier.contains_prefix_many([keys for keys, _ in batch])
                    for (keys, _), n in zip(batch, counts, strict=True):
                        self._found(keys, n, since)
                except Exception:  # the tier never raises; this thread must never die either
                    logger.exception("KV tier lookups failed; treated as misses")
            with self._lock:
                self._looked_up += sum(len(keys) for keys, _ in batch)
            for (_, future), n in zip(batch, counts, strict=True):
                future.set_result(n)
            if stop:
                return

    # ---- loads -------------------------------------------------------------------------------

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
        copier = self.copier
        copier.check(k_caches, v_caches)
        started = time.perf_counter()
        loaded = 0
        # One fingerprint for the whole load: the keys read and the headers checked name the same
        # model even if a weight update changes the connector's fingerprint meanwhile.
        fingerprint = self.fingerprint
        chunk_len = copier.load_chunk
        for start in range(0, len(hashes), chunk_len):
            if self._closed:
                break
            chunk = hashes[start : start + chunk_len]
            keys = [tier_key(fingerprint, h) for h in chunk]
            since = self._reading()
            values = self.tier.fetch(keys)
            present = next((i for i, v in enumerate(values) if v is None), len(values))
            self._found(keys, present, since)
            blocks: list[torch.Tensor] = []
            for block_hash, value in zip(chunk, values, strict=True):
                if value is None:
                    break
                tensor, reason = codec.decode_with_reason(
                    block_hash, value, copier.dtype, copier.block_shape, fingerprint=fingerprint
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
                copier.copy_in(blocks, block_ids[start : start + len(blocks)], k_caches, v_caches)
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
        self.copier.check(k_caches, v_caches)
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

    # ---- end ---------------------------------------------------------------------------------

    def _stop_reads(self) -> bool:
        """From now on every lookup and load answers 0 (a load under way stops at its next chunk);
        ``False`` if already stopped."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            return True

    def _end_reads(self, timeout: float) -> None:
        """After ``_stop_reads``: wait for the loads under way, answer the queued lookups, end the threads."""
        self._loader.shutdown(wait=True, cancel_futures=True)
        if self._lookup_thread is not None:
            self._lookups.put(None)  # answers what is queued (misses: closed), then stops
            self._lookup_thread.join(timeout)


def _parse_key(key: str) -> tuple[str, bytes]:
    """The model fingerprint and block hash a tier key names (``kvcache.keys.tier_key``): the key's,
    not the connector's, which a weight update may have changed since the key was made."""
    fingerprint, _, hex_hash = key[len(KEY_PREFIX) + 1 :].rpartition(":")
    return fingerprint, bytes.fromhex(hex_hash)
