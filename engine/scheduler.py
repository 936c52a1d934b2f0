"""Continuous batching with chunked prefill, prefix caching and preemption by recompute.

Each step spends a token budget (``max_num_batched_tokens``) over at most ``max_num_seqs``
requests. Running requests go first, in admission order, each getting
``min(num_tokens - num_computed_tokens, budget left)`` tokens: one for a decode, a chunk for a
long prompt (at most ``long_prefill_token_threshold`` when set, so one long prompt cannot make a
step, and so every running decode's next token, wait long). Waiting requests are then admitted
in arrival order while budget, sequence slots and blocks last. When a running request needs a
block and none is free, the most recently admitted running request is preempted (blocks freed,
put back at the head of the queue to be recomputed, mostly from the prefix cache): the oldest
request always progresses, so none starves.

A waiting request whose next uncached prompt block is one a running request is computing right
now (same chained hash) waits for it instead of computing it too: it is skipped, keeping its place
in the queue, until that block is cached, then admitted with it as a prefix-cache hit. Bursts of
requests sharing a system prompt, and the n > 1 choices of one prompt, compute the shared part once.
The owner is running, so the wait ends when its prefill passes the shared blocks.

Under ``--scheduling-policy priority`` (vLLM's), the waiting queue and the running set are kept in
(priority, arrival) order, lower priority values first: the preemption victim is then the running
request of the lowest priority (latest arrival among equals), and a waiting request that finds no
sequence slot or no blocks preempts running requests of a strictly lower priority to get them.
Among equal priorities everything is as above.

With prefix caching, a request's last, partly filled block outlives it as a cached partial block
(finished, aborted or preempted: ``_free``). A later request whose next block starts with those
tokens, under the same preceding blocks and salt, gets a fresh block of its own and the step copies
the cached block's KV into it before the forward pass (``SchedulerOutput.copies``), so it computes
only what follows. Each beam search step (a one-token request per beam, extending its parent's
tokens by one) and a chat's next turn (extending the previous answer) compute little more than
their new tokens. Skipped when every layer slides (blocks are given back behind the window) and
for blocks the KV tier is loading.

When the KV connector can load asynchronously (``load_blocks_async``), a request whose prefix is
in the tier is parked while its blocks load, so tier I/O never stalls other requests' steps; it
joins the running set, with the loaded tokens counted as computed, in the first step after the
load finishes. Likewise a remote tier's lookup (``num_loadable_blocks_async``) starts when a
request arrives, so it is usually answered by the time the request is admitted; one still out
``TIER_LOOKUP_GRACE_S`` after it started does not hold the step: the request keeps its place and
others are admitted past it until the answer is in. A slow tier then delays the requests that
ask it, not every request behind them.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.kv_connector import KVConnector
from engine.sequence import Request, RequestStatus

# How long admission waits for a tier lookup, counted from when it started (at arrival): a
# healthy Redis answers in about a millisecond; past this, other requests are admitted first.
TIER_LOOKUP_GRACE_S = 0.02


@dataclass
class _TierLookup:
    """A request's tier lookup: the tier holds ``result`` leading blocks of its blocks
    ``first .. first + count - 1`` (once ``future``, when asynchronous, is done)."""

    first: int
    count: int
    future: Future | None = None  # None once answered
    result: int = 0
    started: float = 0.0


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    long_prefill_token_threshold: int = 0  # most tokens of one prefill per step; 0: no cap
    # The attention window when every layer has one (Mistral-7B-v0.1): blocks wholly behind it are
    # given back while a request runs, so a request holds about window + chunk tokens of KV.
    sliding_window: int | None = None
    # Pooling requests need every prompt row's hidden state (mean / cls pooling): no prefix reuse.
    pool_every_row: bool = False
    # Distinct LoRA adapters the running requests may use at once (0: no adapters served).
    max_loras: int = 0
    # vLLM's --scheduling-policy priority: queues in (priority, arrival) order instead of arrival
    # order, and a request may preempt running ones of a lower priority (a larger value).
    priority: bool = False
    # Positions of a prefix hit or tier load whose draft KV the proposer holds none of besides those
    # it computed: 1 for the MTP layer (engine/mtp.py), whose entry at a position also depends on
    # the next token, so the last one hit was computed for whichever token followed it there.
    draft_hit_lag: int = 0


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens computed this step, from request.num_computed_tokens on
    start: int  # request.num_computed_tokens when scheduled
    # Of those, draft tokens (request.spec_token_ids) after its last known token: verified this step.
    num_spec: int = 0

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the known tokens and so draws the next one (and,
        with drafts, one at each draft's position)."""
        return self.start + self.num_new_tokens - self.num_spec == self.request.num_tokens


@dataclass(frozen=True)
class BlockCopy:
    """Copy block ``src``'s KV (every layer, every part) into block ``dst`` before the step's
    forward pass: a cached partial block reused by a request admitted this step."""

    src: int
    dst: int


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    copies: list[BlockCopy] = field(default_factory=list)  # run first; sources pinned until then

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class _Parked:
    """A request waiting for its prefix blocks to arrive from the KV tier."""

    request: Request
    future: Future
    hashes: list[bytes]  # hashes of the prefix-cache hits followed by the blocks being loaded
    num_hit: int
    num_ext: int
    aborted: bool = False


LOOKUP_PENDING = -1  # what _admit returns while the request's tier lookup is out


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, connector: KVConnector) -> None:
        self.config = config
        self.block_manager = block_manager
        self.connector = connector
        self.waiting: deque[Request] = deque()
        # In admission order; under the priority policy, in (priority, arrival) order.
        self.running: list[Request] = []
        self._arrivals = itertools.count()
        self.loading: list[_Parked] = []
        # Decided once: a connector that can load on its own thread lets requests park meanwhile.
        self._load_async = getattr(connector, "load_blocks_async", None)
        self._lookup_async = getattr(connector, "num_loadable_blocks_async", None)
        # request id -> its last tier lookup, started when it arrived (or came back to the queue)
        # or at an admission attempt, kept while it waits so each retry does not ask the tier
        # again; dropped at admission (a readmitted request asks again).
        self._tier_lookups: dict[str, _TierLookup] = {}
        # Decided once: partial blocks are kept and reused unless blocks are given back behind a
        # sliding window (a released table slot reads as block 0).
        self._partial = block_manager.enable_partial_caching and config.sliding_window is None
        self.num_preemptions = 0
        self.num_prefix_waits = 0  # admissions put off to reuse a prompt block being computed
        self.prefix_cache_queries = 0  # prompt tokens looked up (cumulative)
        self.prefix_cache_hits = 0  # of which served from the device prefix cache or the tier
        self.partial_prefix_hits = 0  # of which copied from cached partial blocks

    # -- queue management --------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        request.arrival_seq = next(self._arrivals)
        if self.config.priority:
            self._insert_waiting(request)
        else:
            self.waiting.append(request)
        self._start_lookup(request)

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
            self._tier_lookups[req.request_id] = _TierLookup(0, most, future, started=time.monotonic())

    def _insert_waiting(self, request: Request) -> None:
        """Into the queue at its (priority, arrival) place: after every request that goes first."""
        key = _order(request)
        at = len(self.waiting)
        while at > 0 and _order(self.waiting[at - 1]) > key:
            at -= 1
        self.waiting.insert(at, request)

    def _run(self, request: Request) -> None:
        if self.config.priority:
            bisect.insort(self.running, request, key=_order)
        else:
            self.running.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + sum(1 for p in self.loading if not p.aborted)

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

    def preempt_all(self) -> None:
        """Send every running request back to waiting, in order (sleep mode's ``keep``: they
        recompute when the engine wakes)."""
        self.drain_loads()
        for req in reversed(self.running[:]):  # the last first: the first ends up in front
            self._preempt(req)

    def forget_tier_lookups(self) -> None:
        """The weights changed: what the tier held for waiting requests was the old weights'."""
        self._tier_lookups.clear()

    def finish(self, request: Request, reason: str) -> None:
        """End a request (any reason) and free its blocks at once."""
        if request.status is RequestStatus.FINISHED:
            return
        parked = request.status is RequestStatus.LOADING
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif parked:
            # Its blocks are being written by the loader: free them once the load is done.
            next(p for p in self.loading if p.request is request).aborted = True
        else:
            self.waiting.remove(request)
            self._tier_lookups.pop(request.request_id, None)
        request.finish_reason = reason  # the connector reads it
        self.connector.request_finished(request)
        if not parked:
            self._free(request)
        request.status = RequestStatus.FINISHED
        request.metrics.finished_time = time.monotonic()

    # -- the step ----------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager
        if self.loading:
            self._unpark()
        if self.config.sliding_window is not None:
            self._release_passed_blocks()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            remaining = req.num_tokens - req.num_computed_tokens
            n = self._chunk(remaining, budget)
            num_spec = 0
            if req.spec_token_ids:
                if remaining == 1:  # drafts ride along with a decode, as far as the budget goes
                    num_spec = self._chunk(1 + len(req.spec_token_ids), budget) - 1
                    n = 1 + num_spec
                del req.spec_token_ids[num_spec:]
            while not bm.may_append(req.block_table, req.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, n, req.num_computed_tokens, num_spec))
                budget -= n
                i += 1
        if out.preempted:
            return out  # memory is short: admitting more now would only thrash
        pending = self._pending_prompt_blocks() if self.waiting and bm.enable_prefix_caching else None
        loras = self._active_loras() if self.config.max_loras else None
        deferred: list[Request] = []
        num_prefix_waits = 0
        lora_blocked = False
        while self.waiting and budget > 0:
            req = self.waiting[0]
            if len(self.running) + len(self.loading) >= self.config.max_num_seqs:
                freed = self._preempt_for(req, out)
                if freed is None:
                    break
                budget += freed
                continue
            if (
                loras is not None
                and req.lora is not None
                and (lora_blocked or (id(req.lora) not in loras and len(loras) >= self.config.max_loras))
            ):
                # Another adapter would exceed max_loras: it waits, keeping its place, for the
                # running ones to finish. Requests behind it go first only if they run no adapter:
                # later requests for a running adapter would otherwise keep it out for ever.
                deferred.append(self.waiting.popleft())
                lora_blocked = True
                continue
            if pending and self._waits_for_pending(req, pending):
                deferred.append(self.waiting.popleft())
                num_prefix_waits += 1
                continue
            n = self._admit(req, budget, out.copies)
            if n == LOOKUP_PENDING:
                # Its tier lookup is still out: it keeps its place, and the requests behind it go.
                deferred.append(self.waiting.popleft())
                continue
            if n is None:
                freed = self._preempt_for(req, out)
                if freed is None:
                    break
                budget += freed
                continue
            self._tier_lookups.pop(req.request_id, None)
            self.waiting.popleft()
            if pending is not None:
                pending.update(self._uncached_prompt_blocks(req))
            if loras is not None and req.lora is not None:
                loras.add(id(req.lora))
            if n == 0:
                continue  # parked while its prefix loads from the tier
            self._run(req)
            out.scheduled.append(ScheduledRequest(req, n, req.num_computed_tokens))
            budget -= n
        self.waiting.extendleft(reversed(deferred))  # back at the head, in their order
        self.num_prefix_waits += num_prefix_waits
        return out

    def _preempt_for(self, req: Request, out: SchedulerOutput) -> int | None:
        """Under the priority policy, preempt the last running request (the lowest priority, latest
        arrival) if ``req`` outranks it, to make room for ``req``: the budget it gives back (its
        tokens, when it was scheduled this step), or None when nothing may be preempted."""
        if not self.config.priority or not self.running or self.running[-1].priority <= req.priority:
            return None
        victim = self.running[-1]
        freed = 0
        for i, s in enumerate(out.scheduled):
            if s.request is victim:
                freed = s.num_new_tokens
                del out.scheduled[i]
                break
        self._drop_copy(victim, out)
        self._preempt(victim)
        out.preempted.append(victim)
        return freed

    def _drop_copy(self, victim: Request, out: SchedulerOutput) -> None:
        """A request admitted this step with a partial block hit is preempted before its copy ran:
        drop the copy, and its partial tokens, which its block does not hold (nothing keeps them)."""
        if not out.copies or not victim.block_table:
            return
        owned = set(victim.block_table)
        for c in [c for c in out.copies if c.dst in owned]:
            out.copies.remove(c)
            self.block_manager.unpin(c.src)
            bs = self.block_manager.block_size
            victim.num_computed_tokens -= victim.num_computed_tokens % bs

    def _active_loras(self) -> set[int]:
        """The adapters (by object) of the running and parked requests."""
        active = {id(r.lora) for r in self.running if r.lora is not None}
        active.update(id(p.request.lora) for p in self.loading if p.request.lora is not None)
        return active

    # -- sharing prompt blocks being computed ------------------------------------------------------

    def _uncached_prompt_blocks(self, req: Request) -> list[bytes]:
        """Hashes of the full prompt blocks ``req`` will compute but has not cached yet."""
        full = req.num_prompt_tokens // self.block_manager.block_size
        first = req.num_registered_blocks
        if first >= full or req.params.prompt_logprobs is not None:
            return []
        return req.full_block_hashes()[first:full]

    def _pending_prompt_blocks(self) -> set[bytes]:
        pending: set[bytes] = set()
        for req in self.running:
            pending.update(self._uncached_prompt_blocks(req))
        for p in self.loading:
            pending.update(p.hashes[p.num_hit :])
        return pending

    def _waits_for_pending(self, req: Request, pending: set[bytes]) -> bool:
        """Whether the first block ``req`` would compute is being computed by another request."""
        if req.params.prompt_logprobs is not None:
            return False  # computes every prompt row anyway
        bm = self.block_manager
        hashes = req.full_block_hashes()
        num_hit = len(bm.match_prefix(req.token_ids, hashes, req.num_tokens - 1))
        last = (req.num_tokens - 1) // bm.block_size  # blocks a hit may cover: one token stays
        return num_hit < last and hashes[num_hit] in pending

    def _chunk(self, remaining: int, budget: int) -> int:
        """Tokens a request computes this step: what it has left, within the budget and, for a
        prefill, within ``long_prefill_token_threshold``."""
        cap = self.config.long_prefill_token_threshold
        return min(remaining, budget, cap) if cap > 0 else min(remaining, budget)

    def _admit(self, req: Request, budget: int, copies: list[BlockCopy]) -> int | None:
        """Match the prefix cache (and the tier, then a cached partial block) and allocate blocks.
        Returns the tokens to compute now, 0 when the request was parked for an asynchronous tier
        load, ``LOOKUP_PENDING`` while its tier lookup is out, None when blocks are short. A
        partial block hit adds its copy to ``copies``."""
        bm = self.block_manager
        bs = bm.block_size
        hashes = req.full_block_hashes()
        # Keep at least one token to compute: its logits draw the next token.
        reuse = self._reuses(req)
        most = (req.num_tokens - 1) // bs  # blocks a hit may cover
        if self.config.sliding_window is not None:
            # Under a window a sequence may outgrow the cache; a hit must still leave room for a
            # step's blocks, or the allocation below could never succeed.
            most = max(0, min(most, bm.num_blocks - bm.blocks_for(self._chunk(req.num_tokens, budget)) - 1))
        hits = bm.match_prefix(req.token_ids, hashes, most * bs) if reuse else []
        num_hit = len(hits)
        ext_hashes = hashes[num_hit:most] if reuse else []
        num_ext = self._num_loadable(req, num_hit, ext_hashes)
        if num_ext is None:
            return LOOKUP_PENDING
        cached_tokens = (num_hit + num_ext) * bs
        if num_ext and self._load_async is not None:
            if not bm.allocate(req.block_table, hits, cached_tokens):
                return None
            ext_ids = req.block_table[num_hit : num_hit + num_ext]
            future = self._load_async(req, ext_ids, ext_hashes[:num_ext])
            self.loading.append(_Parked(req, future, hashes[: num_hit + num_ext], num_hit, num_ext))
            self._count_tier_misses(len(ext_hashes) - num_ext)
            self._count_admission(req, 0)
            req.status = RequestStatus.LOADING
            return 0
        partial = self._match_partial(req, hashes, num_hit) if reuse and not num_ext else None
        if partial is not None:
            bm.pin(partial[0])  # not evicted by the allocation below
            n = self._chunk(req.num_tokens - cached_tokens - partial[1], budget)
            if bm.allocate(req.block_table, hits, cached_tokens + partial[1] + n):
                copies.append(BlockCopy(partial[0], req.block_table[num_hit]))
                self.partial_prefix_hits += partial[1]
                cached_tokens += partial[1]
            else:
                # The pinned block may be the very one the request lacks (it needs every free
                # block): a hit must never make a request unschedulable, so try without it.
                bm.unpin(partial[0])
                partial = None
        if partial is None:
            n = self._chunk(req.num_tokens - cached_tokens, budget)
            if not bm.allocate(req.block_table, hits, cached_tokens + n):
                return None
        if num_ext:
            ext_ids = req.block_table[num_hit : num_hit + num_ext]
            loaded = max(0, min(num_ext, self.connector.load_blocks(req, ext_ids, ext_hashes[:num_ext])))
            if loaded < num_ext:
                # The tier fell short: recompute from the first missing block (blocks already allocated).
                cached_tokens = (num_hit + loaded) * bs
                n = min(
                    self._chunk(req.num_tokens - cached_tokens, budget),
                    len(req.block_table) * bs - cached_tokens,
                )
            req.num_registered_blocks = bm.cache_full_blocks(
                req.block_table, req.token_ids, hashes[: num_hit + loaded], num_hit
            )
        else:
            req.num_registered_blocks = num_hit
        req.num_computed_tokens = cached_tokens
        # A draft model holds KV for what this engine computed, not for what the tier loaded.
        req.num_draft_computed = max(
            0, (num_hit * bs if num_ext else cached_tokens) - self.config.draft_hit_lag
        )
        self._count_tier_misses(len(ext_hashes) - num_ext)
        self._count_admission(req, cached_tokens)
        req.status = RequestStatus.RUNNING
        return n

    def _count_tier_misses(self, num_blocks: int) -> None:
        """The blocks an admitted request asked the tier for and the tier lacked (those it found
        count as hits or misses when loaded)."""
        if num_blocks > 0:
            self.connector.count_lookup_misses(num_blocks)

    def _match_partial(self, req: Request, hashes: list[bytes], num_hit: int) -> tuple[int, int] | None:
        """A cached partial block holding the first tokens of ``req``'s block ``num_hit`` (the one
        after its full-block hits), leaving at least one token to compute: (block id, tokens)."""
        if not self._partial:
            return None
        bs = self.block_manager.block_size
        start = num_hit * bs
        most = min(bs - 1, req.num_tokens - 1 - start)
        if most < 1:
            return None
        parent = (hashes[num_hit - 1] if num_hit else None, req.partial_extra(num_hit))
        return self.block_manager.match_partial(parent, req.token_ids[start : start + most])

    def _free(self, req: Request) -> None:
        """Free a request's blocks, keeping its last block as a cached partial block when it holds
        written KV but is not full."""
        bm = self.block_manager
        if self._partial:
            k, m = divmod(req.num_computed_tokens, bm.block_size)
            if m and k < len(req.block_table):
                parent = (req.full_block_hashes()[k - 1] if k else None, req.partial_extra(k))
                start = k * bm.block_size
                bm.cache_partial_block(req.block_table[k], parent, req.token_ids[start : start + m])
        bm.free(req.block_table, req.num_released_blocks)
        req.num_released_blocks = 0

    def _reuses(self, req: Request) -> bool:
        """Whether ``req`` may take cached KV. Prompt logprobs need every prompt row's logits, so
        such requests compute everything (as do pooling requests that pool every row)."""
        return req.params.prompt_logprobs is None and not (req.pooling and self.config.pool_every_row)

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
                look = _TierLookup(
                    first, len(ext_hashes), result=self.connector.num_loadable_blocks(req, ext_hashes)
                )
            else:
                look = _TierLookup(first, len(ext_hashes), future, started=time.monotonic())
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

    def _count_admission(self, req: Request, cached_tokens: int) -> None:
        if not req.admitted_once:
            req.admitted_once = True
            req.num_cached_tokens = cached_tokens
            req.metrics.first_scheduled_time = time.monotonic()
            self.prefix_cache_queries += req.num_prompt_tokens
            self.prefix_cache_hits += cached_tokens

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

    def _release_passed_blocks(self) -> None:
        """Give back the blocks no future query can see: the next query of a running request sits
        at position ``num_computed_tokens`` and sees keys from ``num_computed_tokens - window + 1``."""
        window, bs = self.config.sliding_window or 0, self.block_manager.block_size
        for req in self.running:
            passed = max(0, req.num_computed_tokens - window + 1) // bs
            if passed > req.num_released_blocks:
                self.block_manager.release(req.block_table, req.num_released_blocks, passed)
                req.num_released_blocks = passed

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        req.spec_token_ids = []
        self._free(req)
        req.num_computed_tokens = req.num_draft_computed = 0
        req.num_registered_blocks = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        if self.config.priority:
            self._insert_waiting(req)  # ahead of later arrivals of its priority
        else:
            self.waiting.appendleft(req)
        self._start_lookup(req)

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance progress of everything that ran, register blocks that became full, and unpin
        the partial blocks the step copied from."""
        bm = self.block_manager
        for c in out.copies:
            bm.unpin(c.src)
        for s in out.scheduled:
            req = s.request
            # Drafts' KV is written, but counts only once accepted (LLMEngine adds those).
            req.num_computed_tokens = s.start + s.num_new_tokens - s.num_spec
            full = req.num_computed_tokens // bm.block_size
            if full > req.num_registered_blocks:
                hashes = req.full_block_hashes()[:full]
                req.num_registered_blocks = bm.cache_full_blocks(
                    req.block_table, req.token_ids, hashes, req.num_registered_blocks
                )


def _order(request: Request) -> tuple[int, int]:
    """Where a request stands under the priority policy: lower priority values first, then arrival."""
    return request.priority, request.arrival_seq
