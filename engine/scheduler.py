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

Under ``--scheduling-policy priority`` (vLLM's), the waiting queue and the running set are kept in
(priority, arrival) order, lower priority values first: the preemption victim is then the running
request of the lowest priority (latest arrival among equals), and a waiting request that finds no
sequence slot or no blocks preempts running requests of a strictly lower priority to get them.
Among equal priorities everything is as above.

Three parts live in files of their own, ``Scheduler`` inheriting the two that act: the step's
hand-off types (``SchedulerOutput``, engine/scheduler_output.py); sharing KV beyond full-block
prefix hits, by waiting for a prompt block another request is computing and by copying a cached
partial block (engine/scheduler_sharing.py); and the KV tier's lookups and asynchronous loads,
which park a request rather than stall the step (engine/scheduler_tier.py).
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import deque
from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.kv_connector import KVConnector
from engine.scheduler_output import BlockCopy, ScheduledRequest, SchedulerOutput
from engine.scheduler_sharing import BlockSharing
from engine.scheduler_tier import Parked, TierAdmission, TierLookup
from engine.sequence import Request, RequestStatus


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


LOOKUP_PENDING = -1  # what _admit returns while the request's tier lookup is out


class Scheduler(TierAdmission, BlockSharing):
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, connector: KVConnector) -> None:
        self.config = config
        self.block_manager = block_manager
        self.connector = connector
        self.waiting: deque[Request] = deque()
        # In admission order; under the priority policy, in (priority, arrival) order.
        self.running: list[Request] = []
        self._arrivals = itertools.count()
        self.loading: list[Parked] = []
        # Decided once: a connector that can load on its own thread lets requests park meanwhile.
        self._load_async = getattr(connector, "load_blocks_async", None)
        self._lookup_async = getattr(connector, "num_loadable_blocks_async", None)
        # request id -> its last tier lookup, started when it arrived (or came back to the queue)
        # or at an admission attempt, kept while it waits so each retry does not ask the tier
        # again; dropped at admission (a readmitted request asks again).
        self._tier_lookups: dict[str, TierLookup] = {}
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

    def preempt_all(self) -> None:
        """Send every running request back to waiting, in order (sleep mode's ``keep``: they
        recompute when the engine wakes)."""
        self.drain_loads()
        for req in reversed(self.running[:]):  # the last first: the first ends up in front
            self._preempt(req)

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

    def _active_loras(self) -> set[int]:
        """The adapters (by object) of the running and parked requests."""
        active = {id(r.lora) for r in self.running if r.lora is not None}
        active.update(id(p.request.lora) for p in self.loading if p.request.lora is not None)
        return active

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
            self.loading.append(Parked(req, future, hashes[: num_hit + num_ext], num_hit, num_ext))
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

    def _reuses(self, req: Request) -> bool:
        """Whether ``req`` may take cached KV. Prompt logprobs need every prompt row's logits, so
        such requests compute everything (as do pooling requests that pool every row)."""
        return req.params.prompt_logprobs is None and not (req.pooling and self.config.pool_every_row)

    def _count_admission(self, req: Request, cached_tokens: int) -> None:
        if not req.admitted_once:
            req.admitted_once = True
            req.num_cached_tokens = cached_tokens
            req.metrics.first_scheduled_time = time.monotonic()
            self.prefix_cache_queries += req.num_prompt_tokens
            self.prefix_cache_hits += cached_tokens

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
