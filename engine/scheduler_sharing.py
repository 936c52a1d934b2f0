"""How the scheduler shares KV beyond full-block prefix hits (``Scheduler`` inherits ``BlockSharing``).

A waiting request whose next uncached prompt block is one a running request is computing right
now (same chained hash) waits for it instead of computing it too: it is skipped, keeping its place
in the queue, until that block is cached, then admitted with it as a prefix-cache hit. Bursts of
requests sharing a system prompt, and the n > 1 choices of one prompt, compute the shared part once.
The owner is running, so the wait ends when its prefill passes the shared blocks.

With prefix caching, a request's last, partly filled block outlives it as a cached partial block
(finished, aborted or preempted: ``_free``). A later request whose next block starts with those
tokens, under the same preceding blocks and salt, gets a fresh block of its own and the step copies
the cached block's KV into it before the forward pass (``SchedulerOutput.copies``), so it computes
only what follows. Each beam search step (a one-token request per beam, extending its parent's
tokens by one) and a chat's next turn (extending the previous answer) compute little more than
their new tokens. Skipped when every layer slides (blocks are given back behind the window) and
for blocks the KV tier is loading.

These are answers and bookkeeping for ``Scheduler.schedule`` and ``_admit``, which decide: nothing
here admits, preempts or reorders a request. A partial block a copy reads stays pinned until the
copy ran (``update_after_step``) or was dropped with its request (``_drop_copy``), never longer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.block_manager import BlockManager
    from engine.scheduler_output import SchedulerOutput
    from engine.scheduler_tier import Parked
    from engine.sequence import Request


class BlockSharing:
    """``Scheduler``'s waits for prompt blocks being computed and its cached partial blocks. Uses its
    ``block_manager``, ``running``, ``loading`` and ``_partial`` (whether partial blocks are kept,
    decided in its ``__init__``)."""

    block_manager: BlockManager
    running: list[Request]
    loading: list[Parked]
    _partial: bool

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

    # -- cached partial blocks ---------------------------------------------------------------------

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
