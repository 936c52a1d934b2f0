"""Re-publication: write again the prefix-cache blocks a tier lost or missed.

While a tier is down (the breaker open) block writes are dropped; a Redis that restarts, or is
flushed, comes back empty; a write queue that is full drops writes. The blocks concerned stay in
this replica's device prefix cache and keep hitting there, so they would never be written again:
every other replica recomputes them. A *pass* makes up for it. It starts

* when the tier's ``epoch()`` moves (the breaker closed after an open, the Redis server's ``run_id``
  changed, its flush marker vanished): over every full block the prefix cache holds;
* when writes were dropped for a full queue (``KVConnector.take_dropped_writes``: the writer
  remembers their hashes, a bounded number) and the queue has room again: over those blocks (over
  the whole prefix cache if more were dropped than remembered); likewise, once their back-off
  passed, over the blocks whose writes the server refused for a reason that passes (OOM under
  ``noeviction``, a read-only replica after a failover, MISCONF; ``kvcache/writer.py``).

A pass asks the tier which of its blocks it lacks (one ``contains_many`` round trip per
``CHECK_CHUNK`` blocks, on this module's own thread) and writes those through the connector's normal
path (snapshot now, ``BlockWriter`` later), so keys, bytes, fingerprint tags and tier events are
exactly a normal write's.

Everything the engine thread does here is bounded and never waits on the network: ``step`` reads
an integer epoch and a flag, looks at a finished future, and snapshots at most ``BLOCKS_PER_STEP``
blocks (``BYTES_PER_STEP`` bytes) into
writer slots it may take without crowding out the writes of blocks filling meanwhile (half the
queue stays theirs). A pass stops, logged with its counts, when the tier is unreachable again (a
newer recovery starts a new pass), when the weights change (no block is ever written under a
stale fingerprint: the snapshot takes the connector's fingerprint, and the pass is cancelled
when it changes), when the KV cache is released (sleep mode), or when it has gone through every
block. Blocks evicted locally before their turn are skipped and counted.

A block that looks absent because its write is still in the writer (queued, being written, or
acknowledged since the pass started: ``KVConnector.write_covers``) is not queued again: each block
is written once. A block a check finds gone that this replica had seen held is reported in a
``removed`` tier event (``kvcache/tier_presence.py``).

Not covered: blocks Redis evicted (``maxmemory``) or an operator deleted one by one while this
replica keeps hitting them on its device: no cheap signal tells it (an evicted flush marker reads
as a flush: one pass). The next replica that reads such a block finds it gone, reports it removed,
computes it and writes it again.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from kvcache.connector import KVConnector

logger = logging.getLogger(__name__)

BLOCKS_PER_STEP = 32  # snapshots queued per engine step at most (one writer batch) ...
BYTES_PER_STEP = 8 << 20  # ... and at most this many bytes of them (big models' blocks are MBs)
CHECK_CHUNK = 256  # blocks per existence check (one round trip on Redis)
MAX_CHECK_FAILURES = 3  # failed checks in a row while the tier still looks reachable: give up
DROPPED = "dropped writes"  # the cause of a pass over writes dropped for a full queue or refused


class RegisteredBlocks(Protocol):
    """What a pass reads of the engine's block manager (on the engine thread)."""

    def registered_hashes(self) -> list[bytes]: ...

    def block_of(self, block_hash: bytes) -> int | None: ...


@dataclass
class _Pass:
    cause: str  # for the log: "epoch 3", or DROPPED
    fingerprint: str
    hashes: list[bytes]  # the prefix cache's full blocks when the pass started, parents first
    started: float
    mark: int  # the writer's acknowledged writes when it started (``KVConnector.write_covers``)
    cursor: int = 0  # hashes[:cursor] were checked (or are being checked)
    check: Future | None = None
    checking: list[bytes] = field(default_factory=list)
    since: int = 0  # the connector's presence generation when ``check`` was sent
    failures: int = 0
    missing: deque[bytes] = field(default_factory=deque)  # lacked by the tier, not yet queued
    checked: int = 0
    lacked: int = 0
    queued: int = 0
    evicted: int = 0


class Republisher:
    """See the module docstring. ``step`` and ``cancel`` run on the engine loop thread only."""

    def __init__(
        self,
        kv: KVConnector,
        blocks: RegisteredBlocks,
        *,
        blocks_per_step: int | None = None,
        check_chunk: int = CHECK_CHUNK,
    ) -> None:
        self.kv = kv
        self.blocks = blocks
        # The snapshot is a device-to-host copy on the engine thread: bounded by bytes, not blocks.
        if blocks_per_step is None:
            blocks_per_step = max(1, min(BLOCKS_PER_STEP, BYTES_PER_STEP // kv.block_bytes))
        self.blocks_per_step = blocks_per_step
        self.check_chunk = check_chunk
        self._epoch = kv.tier.epoch()
        self._pass: _Pass | None = None
        self._checker: ThreadPoolExecutor | None = None  # started by the first pass
        self.passes = 0  # passes started (tests, stats)
        self.last_outcome: str | None = None  # how the last pass ended

    @property
    def active(self) -> bool:
        return self._pass is not None

    def has_work(self) -> bool:
        """A pass runs, the tier came back since the last one started, or writes were dropped for a
        full queue or refused (their back-off passed) and the tier answers (any thread; no I/O)."""
        if self._pass is not None or self.kv.tier.epoch() != self._epoch:
            return True
        # Dropped writes wait for a tier that answers (``_start_dropped``): no spinning meanwhile.
        return self.kv.has_dropped_writes and self.kv.tier.available()

    @property
    def queued(self) -> int:
        """Blocks the running pass queued for writing so far (0 when none runs)."""
        return self._pass.queued if self._pass is not None else 0

    def step(self, k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor]) -> None:
        """Advance the pass by a bounded amount; start one if the tier came back since the last, or
        if writes were dropped for a full queue and it has room again."""
        epoch = self.kv.tier.epoch()
        if epoch != self._epoch:
            self._epoch = epoch
            if self._pass is not None:
                self._end("superseded: the tier came back again")
            self.kv.take_dropped_writes()  # the whole prefix cache is checked: it holds them
            self._start_recovery(epoch)
        elif self._pass is None and self.kv.has_dropped_writes and k_caches:
            self._start_dropped()
        p = self._pass
        if p is None:
            return
        if not k_caches or p.fingerprint != self.kv.fingerprint:
            self._end("cancelled: the KV cache or the weights changed")
            return
        if p.check is not None and p.check.done():
            if not self._take_check(p):
                return
        if p.missing:
            if not self.kv.tier.available():
                self._end("stopped: the tier is unreachable again")
                return
            self._write(p, k_caches, v_caches)
        if p.check is None and len(p.missing) <= self.check_chunk:
            if p.cursor < len(p.hashes):
                self._check_next(p)
            elif not p.missing:
                self._end("done")

    def cancel(self, reason: str) -> None:
        """End the pass now (sleep mode, a weight update): its blocks may no longer be the model's,
        nor those whose writes were dropped (forgotten too)."""
        self.kv.take_dropped_writes()
        if self._pass is not None:
            self._end(f"cancelled: {reason}")

    def close(self) -> None:
        if self._checker is not None:
            self._checker.shutdown(wait=True, cancel_futures=True)

    # -- internals ---------------------------------------------------------------------------------

    def _start_recovery(self, epoch: int) -> None:
        hashes = self.blocks.registered_hashes()
        self._start(f"epoch {epoch}", hashes)
        logger.info(
            "KV tier back (epoch %d): checking the %d full blocks of the prefix cache for re-publication",
            epoch,
            len(hashes),
        )

    def _start_dropped(self) -> None:
        """Writes were dropped for a full queue: once it has room again (and the tier answers; else a
        recovery's pass covers them), check those blocks and write what the tier lacks."""
        if not self.kv.can_republish() or not self.kv.tier.available():
            return
        hashes, overflow = self.kv.take_dropped_writes(due_only=True)
        if overflow:
            hashes = self.blocks.registered_hashes()
        self._start(DROPPED, hashes)
        # Debug: under a sustained overload one pass follows another; the drops are counted already.
        logger.debug(
            "KV tier writes dropped for a full queue or refused by the server: checking %d blocks%s "
            "for re-publication",
            len(hashes),
            " (the whole prefix cache: more writes were dropped than remembered)" if overflow else "",
        )

    def _start(self, cause: str, hashes: list[bytes]) -> None:
        self.passes += 1
        self._pass = _Pass(cause, self.kv.fingerprint, hashes, time.monotonic(), self.kv.write_mark())

    def _check_next(self, p: _Pass) -> None:
        chunk: list[bytes] = []
        while p.cursor < len(p.hashes) and len(chunk) < self.check_chunk:
            h = p.hashes[p.cursor]
            p.cursor += 1
            if self.blocks.block_of(h) is None:
                p.evicted += 1
            else:
                chunk.append(h)
        if chunk:
            self._submit(p, chunk)

    def _submit(self, p: _Pass, chunk: list[bytes]) -> None:
        if self._checker is None:
            self._checker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-tier-republish")
        keys = self.kv.keys(chunk)  # the pass's fingerprint: it is the connector's (checked each step)
        p.checking = chunk
        p.since = self.kv.presence.generation if self.kv.presence is not None else 0
        p.check = self._checker.submit(self.kv.tier.contains_many, keys)

    def _take_check(self, p: _Pass) -> bool:
        """Fold a finished check into ``missing``; False if the pass ended."""
        assert p.check is not None
        try:
            flags = p.check.result()
        except Exception:  # the tier never raises; a bug here must not kill the engine loop
            logger.exception("KV tier re-publication check failed")
            flags = None
        p.check = None
        if flags is None:
            p.failures += 1
            if not self.kv.tier.available():
                self._end("stopped: the tier is unreachable again")
                return False
            if p.failures >= MAX_CHECK_FAILURES:
                self._end("stopped: the tier did not answer its existence checks")
                return False
            self._submit(p, p.checking)  # a passing failure (the breaker still closed): ask again
            return True
        p.failures = 0
        p.checked += len(flags)
        lacked = [h for h, present in zip(p.checking, flags, strict=True) if not present]
        self.kv.report_absent(lacked, p.since)  # gone since this replica saw them: removed events
        # A block whose write is queued, being written or done since the pass started (its block
        # filled just before, another pass's) only looked absent: its write lands anyway.
        lacked = [h for h in lacked if not self.kv.write_covers(h, p.mark)]
        p.lacked += len(lacked)
        p.missing.extend(lacked)
        p.checking = []
        return True

    def _write(self, p: _Pass, k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor]) -> None:
        hashes: list[bytes] = []
        ids: list[int] = []
        while p.missing and len(hashes) < self.blocks_per_step:
            h = p.missing.popleft()
            bid = self.blocks.block_of(h)
            if bid is None:
                p.evicted += 1
                continue
            if self.kv.write_covers(h, p.mark):  # written meanwhile (the writer's own path)
                continue
            hashes.append(h)
            ids.append(bid)
        if not hashes:
            return
        n = self.kv.republish(hashes, ids, k_caches, v_caches)
        p.queued += n
        p.missing.extendleft(reversed(hashes[n:]))  # no writer slot now: next step

    def _end(self, outcome: str) -> None:
        p = self._pass
        assert p is not None
        self._pass = None
        self.last_outcome = outcome
        if outcome != "done":
            log = logger.warning
        else:
            log = logger.debug if p.cause == DROPPED else logger.info
        log(
            "KV tier re-publication pass (%s) %s after %.2fs: %d of %d prefix-cache blocks "
            "checked, %d lacked by the tier, %d queued for writing, %d evicted locally first",
            p.cause,
            outcome,
            time.monotonic() - p.started,
            p.checked,
            len(p.hashes),
            p.lacked,
            p.queued,
            p.evicted,
        )
