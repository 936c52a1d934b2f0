"""Paged KV block bookkeeping: ref counts, the prefix cache and LRU eviction.

Block ids index the first dimension of every layer's ``k_cache``/``v_cache``. A block is in
exactly one state:
* used: ref_count > 0 (in the block table of at least one running request);
* cached: ref_count == 0 but holds a full block registered under its content hash, reusable by a
  later request with the same prefix until it is evicted (least recently freed first);
* cached partial: ref_count == 0 and holds the first tokens of a block (a finished request's last,
  partly filled block), kept under what precedes it (``PartialParent``) and those tokens; a later
  request that extends them copies its KV into a block of its own (copy-on-write, the scheduler's
  ``BlockCopy``). It is in the same LRU as cached full blocks, but never has a hash: it is never
  announced to listeners, so never reaches the KV tier or KV events;
* free: ref_count == 0 and holds nothing worth keeping.

A cached partial block being copied from is pinned (``pin``/``unpin``: ref counted, out of the LRU)
until the copy has run, and stays findable meanwhile.

Shortage is signalled by return value (``False``), never by an exception: the scheduler decides
whether to wait or preempt. A hash hit is re-checked against the block's token ids, so a hash
collision can never serve wrong KV.

Listeners (``add_listener``) hear "block became full under hash h" (after its KV was written) and
"cached block evicted": the KV tier attaches its writes and its block events there.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

# What precedes a partial block: the hash of the full block before it (None for a request's first
# block) and the request's root salt (``Request.block_extra``: LoRA adapter, cache_salt). A full
# block's hash already covers the salt; the first block has only the salt to tell it apart.
PartialParent = tuple[bytes | None, bytes]


class BlockListener(Protocol):
    def block_stored(
        self, block_id: int, block_hash: bytes, parent_hash: bytes | None, token_ids: tuple[int, ...]
    ) -> None:
        """Block ``block_id`` is now full, its KV written, and registered under ``block_hash``."""

    def block_removed(self, block_id: int, block_hash: bytes) -> None:
        """The cached block was evicted: its hash no longer maps to KV on this engine."""


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None  # a full block's tokens, or a partial block's first ones
    partial_parent: PartialParent | None = None  # set only on a cached partial block


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        enable_partial_caching: bool = True,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.enable_partial_caching = enable_prefix_caching and enable_partial_caching
        # parent -> {first tokens -> block id}: the cached partial blocks
        self._partial: dict[PartialParent, dict[tuple[int, ...], int]] = {}
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # LRU order: first = evicted first
        self._by_hash: dict[bytes, int] = {}
        self._listeners: list[BlockListener] = []
        self.prefix_cache_resets = 0  # times the prefix cache was emptied (a router's cue to forget it)

    # -- queries -----------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take now (free plus evictable cached)."""
        return len(self._free) + len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Evictable cached blocks, full and partial."""
        return len(self._cached)

    @property
    def num_partial_blocks(self) -> int:
        """Cached partial blocks (evictable, or pinned while being copied from)."""
        return sum(len(entries) for entries in self._partial.values())

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def lookup(self, block_hash: bytes, token_ids: Sequence[int]) -> int | None:
        """The block holding exactly these tokens under this hash, or None."""
        bid = self._by_hash.get(block_hash)
        if bid is None or self.blocks[bid].token_ids != tuple(token_ids):
            return None
        return bid

    def registered_hashes(self) -> list[bytes]:
        """Every full block the prefix cache holds (in use or cached), in the order registered: a
        request registers a block after the one before it. The KV tier's re-publication walks it."""
        return list(self._by_hash)

    def block_of(self, block_hash: bytes) -> int | None:
        """The block registered under ``block_hash`` (its KV is that hash's), or None."""
        return self._by_hash.get(block_hash)

    def match_prefix(self, token_ids: Sequence[int], hashes: Sequence[bytes], max_tokens: int) -> list[int]:
        """Block ids of the longest cached prefix (whole blocks, at most ``max_tokens`` tokens)."""
        if not self.enable_prefix_caching:
            return []
        out: list[int] = []
        bs = self.block_size
        for i, h in enumerate(hashes):
            if (i + 1) * bs > max_tokens:
                break
            bid = self.lookup(h, token_ids[i * bs : (i + 1) * bs])
            if bid is None:
                break
            out.append(bid)
        return out

    def match_partial(self, parent: PartialParent, token_ids: Sequence[int]) -> tuple[int, int] | None:
        """The cached partial block under ``parent`` whose tokens are the longest prefix of
        ``token_ids`` (the tokens a request may reuse in its next block), as (block id, tokens)."""
        entries = self._partial.get(parent)
        if not entries:
            return None
        for m in range(min(len(token_ids), self.block_size - 1), 0, -1):
            bid = entries.get(tuple(token_ids[:m]))
            if bid is not None:
                return bid, m
        return None

    # -- allocation --------------------------------------------------------------------------------

    def can_allocate(self, block_table: Sequence[int], cached: Sequence[int], num_tokens: int) -> bool:
        """Whether ``allocate`` would succeed (the same arithmetic, no changes)."""
        return self._new_needed(block_table, cached, num_tokens) <= self._available_excluding(cached)

    def allocate(self, block_table: list[int], cached: Sequence[int], num_tokens: int) -> bool:
        """Extend ``block_table`` by the prefix-cache hits ``cached`` (shared, ref counted) and then
        fresh blocks until it covers ``num_tokens`` tokens. All or nothing."""
        if not self.can_allocate(block_table, cached, num_tokens):
            return False
        for bid in cached:
            self._touch(bid)
            block_table.append(bid)
        for _ in range(self._new_needed(block_table, (), num_tokens)):
            block_table.append(self._take_block())
        return True

    def may_append(self, block_table: list[int], num_tokens: int) -> bool:
        """Grow ``block_table`` to cover ``num_tokens`` tokens; False (and no change) on shortage."""
        return self.allocate(block_table, (), num_tokens)

    def free(self, block_table: list[int], start: int = 0) -> None:
        """Release a request's blocks from ``start`` on (those before were released already, see
        ``release``) and clear its table. Tail blocks go first into the LRU, so a shared prefix
        outlives the request-specific suffix when memory runs short."""
        for bid in reversed(block_table[start:]):
            self._unref(bid)
        block_table.clear()

    def release(self, block_table: list[int], start: int, stop: int) -> None:
        """Release entries ``start..stop-1`` of a running request's table (blocks its attention
        window has passed). Their slots keep the request's positions and read as block 0, as
        padding does: no attention kernel looks behind the window."""
        for i in range(start, stop):
            self._unref(block_table[i])
            block_table[i] = 0

    def pin(self, bid: int) -> None:
        """Keep a cached (partial) block from eviction until ``unpin``: it is being copied from."""
        self._touch(bid)

    def unpin(self, bid: int) -> None:
        self._unref(bid)

    def _unref(self, bid: int) -> None:
        block = self.blocks[bid]
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.block_hash is not None or block.partial_parent is not None:
                self._cached[bid] = None
            else:
                self._free.append(bid)

    # -- prefix cache registration -----------------------------------------------------------------

    def cache_full_blocks(
        self, block_table: Sequence[int], token_ids: Sequence[int], hashes: Sequence[bytes], num_cached: int
    ) -> int:
        """Register blocks ``num_cached .. len(hashes)-1`` of a request (now full, KV written) under
        their hashes; returns the new count of registered blocks. A block whose hash already maps to
        another block stays unregistered (its twin serves later hits)."""
        if not self.enable_prefix_caching:
            return len(hashes)
        bs = self.block_size
        for i in range(num_cached, len(hashes)):
            block = self.blocks[block_table[i]]
            if block.block_hash is not None:
                continue  # a prefix hit: already registered
            h = hashes[i]
            if h in self._by_hash:
                continue
            block.block_hash = h
            block.token_ids = tuple(token_ids[i * bs : (i + 1) * bs])
            self._by_hash[h] = block.block_id
            parent = hashes[i - 1] if i > 0 else None
            for listener in self._listeners:
                listener.block_stored(block.block_id, h, parent, block.token_ids)
        return len(hashes)

    def cache_partial_block(self, bid: int, parent: PartialParent, token_ids: Sequence[int]) -> bool:
        """Keep block ``bid``, whose first ``token_ids`` hold written KV, as a cached partial block
        once it is freed. The caller (the block's only owner, about to free it) must name exactly
        what precedes it. False when partial caching is off, the block is shared, registered or
        full, or an equal partial block is already cached (that one serves later hits)."""
        block = self.blocks[bid]
        tokens = tuple(token_ids)
        if (
            not self.enable_partial_caching
            or not 0 < len(tokens) < self.block_size
            or block.ref_count != 1
            or block.block_hash is not None
            or block.partial_parent is not None
        ):
            return False
        entries = self._partial.setdefault(parent, {})
        if tokens in entries:
            return False
        entries[tokens] = bid
        block.partial_parent = parent
        block.token_ids = tokens
        return True

    def add_listener(self, listener: BlockListener) -> None:
        self._listeners.append(listener)

    def reset_prefix_cache(self) -> int:
        """Drop every cached (unused) block, full or partial, from the prefix cache; returns how many."""
        self.prefix_cache_resets += 1
        n = 0
        while self._cached:
            bid, _ = self._cached.popitem(last=False)
            self._forget(bid)
            self._free.append(bid)
            n += 1
        return n

    def check_integrity(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (tests call this after scenarios)."""
        used = [b for b in self.blocks if b.ref_count > 0]
        assert all(b.ref_count >= 0 for b in self.blocks), "negative ref count"
        assert len(self._free) + len(self._cached) + len(used) == self.num_blocks, (
            "free + cached + used != total"
        )
        assert len(set(self._free)) == len(self._free), "a block is free twice"
        for bid in self._free:
            block = self.blocks[bid]
            assert block.ref_count == 0 and block.block_hash is None and block.partial_parent is None
        for bid in self._cached:
            block = self.blocks[bid]
            assert block.ref_count == 0, "a cached block is in use"
            assert (block.block_hash is None) != (block.partial_parent is None), (
                "a cached block must be exactly one of full (hash) or partial"
            )
        for h, bid in self._by_hash.items():
            assert self.blocks[bid].block_hash == h, "hash map points at a block holding another hash"
        num_partial = 0
        for parent, entries in self._partial.items():
            assert entries, "empty partial entry list kept"
            for tokens, bid in entries.items():
                block = self.blocks[bid]
                assert block.partial_parent == parent and block.token_ids == tokens, (
                    "partial map points at a block holding other tokens"
                )
                assert 0 < len(tokens) < self.block_size, "a partial block must be partly filled"
                num_partial += 1
        assert num_partial == sum(b.partial_parent is not None for b in self.blocks), (
            "a partial block is missing from the partial map"
        )
        if not self.enable_partial_caching:
            assert num_partial == 0, "partial blocks cached while partial caching is off"

    # -- internals ---------------------------------------------------------------------------------

    def _new_needed(self, block_table: Sequence[int], cached: Sequence[int], num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(block_table) - len(cached))

    def _available_excluding(self, cached: Sequence[int]) -> int:
        # Cached hits that sit in the LRU are about to be taken by this request, not evicted.
        reused = sum(1 for bid in cached if self.blocks[bid].ref_count == 0)
        return len(self._free) + len(self._cached) - reused

    def _touch(self, bid: int) -> None:
        block = self.blocks[bid]
        if block.ref_count == 0:
            del self._cached[bid]
        block.ref_count += 1

    def _take_block(self) -> int:
        if self._free:
            bid = self._free.popleft()
        else:
            bid, _ = self._cached.popitem(last=False)
            self._forget(bid)
        self.blocks[bid].ref_count = 1
        return bid

    def _forget(self, bid: int) -> None:
        block = self.blocks[bid]
        parent = block.partial_parent
        if parent is not None:  # never announced, so never retracted
            entries = self._partial[parent]
            del entries[block.token_ids]  # type: ignore[arg-type]
            if not entries:
                del self._partial[parent]
            block.partial_parent = None
            block.token_ids = None
            return
        h = block.block_hash
        if h is None:
            return
        del self._by_hash[h]
        block.block_hash = None
        block.token_ids = None
        for listener in self._listeners:
            listener.block_removed(bid, h)
