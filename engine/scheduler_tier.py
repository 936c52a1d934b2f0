"""The scheduler's side of the KV tier (``Scheduler`` inherits ``TierAdmission``): asking the tier
how many of a request's leading blocks it holds, and parking a request while they load.

When the KV connector can load asynchronously (``load_blocks_async``), a request whose prefix is
in the tier is parked while its blocks load, so tier I/O never stalls other requests' steps; it
joins the running set, with the loaded tokens counted as computed, in the first step after the
load finishes. Likewise a remote tier's lookup (``num_loadable_blocks_async``) starts when a
request arrives, so it is usually answered by the time the request is admitted; one still out
``TIER_LOOKUP_GRACE_S`` after it started does not hold the step: the request keeps its place and
others are admitted past it until the answer is in. A slow tier then delays the requests that
ask it, not every request behind them.

Admission itself (``Scheduler._admit``: matching, allocating, parking) stays with the scheduler.
This module never allocates blocks, never frees a parked request's blocks before its load is done
(the loader writes into them), and never lets a failed lookup or load become an error: either is
a miss, and the request computes what the tier did not give it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.sequence import Request, RequestStatus

if TYPE_CHECKING:
    from engine.block_manager import BlockManager
    from engine.kv_connector import KVConnector

# How long admission waits for a tier lookup, counted from when it started (at arrival): a
# healthy Redis answers in about a millisecond; past this, other requests are admitted first.
TIER_LOOKUP_GRACE_S = 0.02


@dataclass
class TierLookup:
    """A request's tier lookup: the tier holds ``result`` leading blocks of its blocks
    ``first .. first + count - 1`` (once ``future``, when asynchronous, is done)."""

    first: int
    count: int
    future: Future | None = None  # None once answered
    result: int = 0
    started: float = 0.0


@dataclass
class Parked:
    """A request waiting for its prefix blocks to arrive from the KV tier."""

    request: Request
    future: Future
    hashes: list[bytes]  # hashes of the prefix-cache hits followed by the blocks being loaded
    num_hit: int
    num_ext: int
    aborted: bool = False


class TierAdmission:
    """``Scheduler``'s tier lookups and parked loads. Uses its ``config``, ``block_manager``,
    ``connector``, ``prefix_cache_hits``, ``_reuses`` and ``_run``, and the state its ``__init__``
    sets for them: ``loading``, ``_tier_lookups``, ``_load_async`` and ``_lookup_async``."""

    block_manager: BlockManager
    connector: KVConnector
    loading: list[Parked]  # requests parked while their prefix blocks load from the tier
    _tier_lookups: dict[str, TierLookup]

    def _start_lookup(self, req: Request) -> None:
        """Ask a remote tier now, on the connector's thread, how many of ``req``'s leading blocks
        it holds, so the answer is in by admission (batched with other arrivals' lookups)."""
        if self._lookup_async is None or not self._reuses(req):
            return
        most = (req.num_tokens - 1) // self.block_manager.block_size
        if most <= 0 or not self.block_manager.enable_prefix_caching:
            return
        future = self._lookup_async(req, req.full_block_hashes()[:most])
        if future is not None:
            self._tier_lookups[req.request_id] = TierLookup(0, most, future, started=time.monotonic())

    def wait_for_tier(
        self, timeout: float, also: Sequence[Future] = (), interrupt: Future | None = None
    ) -> None:
        """Block until a parked request's load, a waiting request's tier lookup or one of
        ``also`` finishes (or ``timeout``): the step found nothing else to run. ``interrupt``
        (set when the caller has new work) cuts the wait short; alone it is not waited on."""
        futures = [p.future for p in self.loading]
        futures += [t.future for t in self._tier_lookups.values() if t.future is not None]
        futures += also
        if futures:
            if interrupt is not None:
                futures.append(interrupt)
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def drain_loads(self) -> None:
        """Wait for every parked request's tier load and settle it (sleep mode: nothing may still
        write into the KV cache when it is freed)."""
        while self.loading:
            wait([p.future for p in self.loading], timeout=0.05, return_when=FIRST_COMPLETED)
            self._unpark()

    def forget_tier_lookups(self) -> None:
        """The weights changed: what the tier held for waiting requests was the old weights'."""
        self._tier_lookups.clear()

    def _count_tier_misses(self, num_blocks: int) -> None:
        """The blocks an admitted request asked the tier for and the tier lacked (those it found
        count as hits or misses when loaded)."""
        if num_blocks > 0:
            self.connector.count_lookup_misses(num_blocks)

    def _num_loadable(self, req: Request, first: int, ext_hashes: list[bytes]) -> int | None:
        """Leading blocks of ``ext_hashes`` (the request's blocks from ``first`` on) in the tier,
        or None while its lookup is still out.

        Asked once per admission attempt series: a request that keeps failing to get blocks
        reuses its answer (the load itself copes with blocks gone since). A lookup that covered
        these blocks answers for them: the one started on arrival asks from the first block, and
        the device prefix cache's hits only move ``first`` on.
        """
        if not ext_hashes:
            return 0
        look = self._tier_lookups.get(req.request_id)
        if look is None or not (look.first <= first and first + len(ext_hashes) <= look.first + look.count):
            future = self._lookup_async(req, ext_hashes) if self._lookup_async is not None else None
            if future is None:
                look = TierLookup(
                    first, len(ext_hashes), result=self.connector.num_loadable_blocks(req, ext_hashes)
                )
            else:
                look = TierLookup(first, len(ext_hashes), future, started=time.monotonic())
            self._tier_lookups[req.request_id] = look
        if look.future is not None:
            if not look.future.done():
                grace = look.started + TIER_LOOKUP_GRACE_S - time.monotonic()
                if grace <= 0 or not wait([look.future], timeout=grace).done:
                    return None
            try:
                look.result = int(look.future.result())
            except Exception:  # a failed lookup is a miss
                look.result = 0
            look.future = None
        # The tier holds blocks look.first .. end - 1; past a block it lacks, nothing is loaded.
        end = look.first + look.result
        return max(0, min(len(ext_hashes), end - first))

    def _unpark(self) -> None:
        """Move requests whose tier load finished into the running set (or free aborted ones)."""
        bm = self.block_manager
        for p in [p for p in self.loading if p.future.done()]:
            self.loading.remove(p)
            req = p.request
            if p.aborted:
                bm.free(req.block_table)
                continue
            try:
                loaded = max(0, min(p.num_ext, int(p.future.result())))
            except Exception:  # a failed load is a miss: recompute
                loaded = 0
            keep = p.num_hit + loaded
            bm.free(req.block_table[keep:])  # blocks that did not load hold nothing usable
            del req.block_table[keep:]
            req.num_registered_blocks = bm.cache_full_blocks(
                req.block_table, req.token_ids, p.hashes[:keep], p.num_hit
            )
            req.num_computed_tokens = keep * bm.block_size
            # The tier's blocks hold no draft KV.
            req.num_draft_computed = max(0, p.num_hit * bm.block_size - self.config.draft_hit_lag)
            if req.num_preemptions == 0:
                req.num_cached_tokens = req.num_computed_tokens
                self.prefix_cache_hits += req.num_computed_tokens
            req.status = RequestStatus.RUNNING
            self._run(req)
