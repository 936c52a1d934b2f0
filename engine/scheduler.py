"""Continuous batching with chunked prefill, prefix caching and preemption by recompute.

Each step spends a token budget (``max_num_batched_tokens``) over at most ``max_num_seqs``
requests. Running requests go first, in admission order, each getting
``min(num_tokens - num_computed_tokens, budget left)`` tokens: one for a decode, a chunk for a
long prompt. Waiting requests are then admitted in arrival order while budget, sequence slots
and blocks last. When a running request needs a block and none is free, the most recently
admitted running request is preempted (blocks freed, put back at the head of the queue to be
recomputed, mostly from the prefix cache): the oldest request always progresses, so none starves.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.kv_connector import KVConnector
from engine.sequence import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens computed this step, from request.num_computed_tokens on
    start: int  # request.num_computed_tokens when scheduled

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the known tokens and so draws the next one."""
        return self.start + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, connector: KVConnector) -> None:
        self.config = config
        self.block_manager = block_manager
        self.connector = connector
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # prompt tokens looked up (cumulative)
        self.prefix_cache_hits = 0  # of which served from the device prefix cache or the tier

    # -- queue management --------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, reason: str) -> None:
        """End a request (any reason) and free its blocks at once."""
        if request.status is RequestStatus.FINISHED:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.connector.request_finished(request)
        self.block_manager.free(request.block_table)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.metrics.finished_time = time.monotonic()

    # -- the step ----------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not bm.may_append(req.block_table, req.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, n, req.num_computed_tokens))
                budget -= n
                i += 1
        if out.preempted:
            return out  # memory is short: admitting more now would only thrash
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            n = self._admit(req, budget)
            if n == 0:
                break
            self.waiting.popleft()
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n, req.num_computed_tokens))
            budget -= n
        return out

    def _admit(self, req: Request, budget: int) -> int:
        """Match the prefix cache (and the tier), allocate blocks; tokens to compute now, 0 if none fit."""
        bm = self.block_manager
        bs = bm.block_size
        hashes = req.full_block_hashes()
        # Keep at least one token to compute: its logits draw the next token.
        # Prompt logprobs need every prompt row's logits, so such requests compute everything.
        reuse = req.params.prompt_logprobs is None
        hits = bm.match_prefix(req.token_ids, hashes, req.num_tokens - 1) if reuse else []
        num_hit = len(hits)
        ext_hashes = hashes[num_hit : (req.num_tokens - 1) // bs] if reuse else []
        num_ext = self.connector.num_loadable_blocks(req, ext_hashes) if ext_hashes else 0
        cached_tokens = (num_hit + num_ext) * bs
        n = min(req.num_tokens - cached_tokens, budget)
        if not bm.allocate(req.block_table, hits, cached_tokens + n):
            return 0
        if num_ext:
            ext_ids = req.block_table[num_hit : num_hit + num_ext]
            loaded = max(0, min(num_ext, self.connector.load_blocks(req, ext_ids, ext_hashes[:num_ext])))
            if loaded < num_ext:
                # The tier fell short: recompute from the first missing block (blocks already allocated).
                cached_tokens = (num_hit + loaded) * bs
                n = min(req.num_tokens - cached_tokens, budget, len(req.block_table) * bs - cached_tokens)
            req.num_registered_blocks = bm.cache_full_blocks(
                req.block_table, req.token_ids, hashes[: num_hit + loaded], num_hit
            )
        else:
            req.num_registered_blocks = num_hit
        req.num_computed_tokens = cached_tokens
        if not req.admitted_once:
            req.admitted_once = True
            req.num_cached_tokens = cached_tokens
            req.metrics.first_scheduled_time = time.monotonic()
            self.prefix_cache_queries += req.num_prompt_tokens
            self.prefix_cache_hits += cached_tokens
        req.status = RequestStatus.RUNNING
        return n

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.block_manager.free(req.block_table)
        req.num_computed_tokens = 0
        req.num_registered_blocks = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance progress of everything that ran and register blocks that became full."""
        bm = self.block_manager
        for s in out.scheduled:
            req = s.request
            req.num_computed_tokens = s.start + s.num_new_tokens
            full = req.num_computed_tokens // bm.block_size
            if full > req.num_registered_blocks:
                hashes = req.full_block_hashes()[:full]
                req.num_registered_blocks = bm.cache_full_blocks(
                    req.block_table, req.token_ids, hashes, req.num_registered_blocks
                )
