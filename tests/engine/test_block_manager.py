"""BlockManager: exact block ids, ref counts, prefix-cache hits and LRU eviction order."""

from __future__ import annotations

from engine.block_manager import BlockManager
from kvcache.keys import block_hashes

BS = 4


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def block_stored(self, block_id, block_hash, parent_hash, token_ids) -> None:  # noqa: ANN001
        self.events.append(("stored", block_id, block_hash, parent_hash, token_ids))

    def block_removed(self, block_id, block_hash) -> None:  # noqa: ANN001
        self.events.append(("removed", block_id, block_hash))


def _fill(bm: BlockManager, tokens: list[int]) -> list[int]:
    """Allocate a fresh request for ``tokens`` (prefix hits first) and register its full blocks."""
    hashes = block_hashes(tokens, BS)
    hits = bm.match_prefix(tokens, hashes, len(tokens) - 1)
    table: list[int] = []
    assert bm.allocate(table, hits, len(tokens))
    bm.cache_full_blocks(table, tokens, hashes, len(hits))
    return table


def test_allocate_takes_lowest_free_ids_and_frees_into_lru() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS)
    a = _fill(bm, list(range(10)))  # 2 full blocks + 2 tokens
    assert a == [0, 1, 2]
    assert [bm.blocks[i].ref_count for i in range(6)] == [1, 1, 1, 0, 0, 0]
    assert bm.num_free_blocks == 3 and bm.num_used_blocks == 3
    bm.free(a)
    assert a == []
    # Full blocks stay cached (reusable), the partial tail block is plainly free.
    assert bm.num_cached_blocks == 2
    assert list(bm._free) == [3, 4, 5, 2]
    bm.check_integrity()


def test_prefix_hit_shares_blocks_and_counts_refs() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt = list(range(100, 112))  # 3 full blocks
    a = _fill(bm, prompt + [1, 2])
    assert a == [0, 1, 2, 3]
    b = _fill(bm, prompt + [7, 8, 9])
    # The 3 shared blocks come from a; b gets one new block for its own tail.
    assert b == [0, 1, 2, 4]
    assert [bm.blocks[i].ref_count for i in range(5)] == [2, 2, 2, 1, 1]
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in range(5)] == [1, 1, 1, 0, 1]
    bm.free(b)
    assert all(bl.ref_count == 0 for bl in bm.blocks)
    bm.check_integrity()


def test_whole_prompt_hit_leaves_last_token_to_compute() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt = list(range(8))
    bm.free(_fill(bm, prompt))
    hashes = block_hashes(prompt, BS)
    # Capped at len - 1 tokens: only the first block may be reused.
    assert bm.match_prefix(prompt, hashes, len(prompt) - 1) == [0]
    assert bm.match_prefix(prompt, hashes, len(prompt)) == [0, 1]


def test_eviction_is_lru_and_fires_removed_events() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    rec = Recorder()
    bm.add_listener(rec)
    a = _fill(bm, [1, 1, 1, 1, 2, 2, 2, 2])  # blocks 0, 1
    b = _fill(bm, [3, 3, 3, 3, 4, 4, 4, 4])  # blocks 2, 3
    ha, hb = block_hashes([1] * 4 + [2] * 4, BS), block_hashes([3] * 4 + [4] * 4, BS)
    assert [e[:2] for e in rec.events] == [("stored", 0), ("stored", 1), ("stored", 2), ("stored", 3)]
    assert rec.events[1][3] == ha[0]  # parent hash of the second block
    assert rec.events[0][3] is None and rec.events[0][4] == (1, 1, 1, 1)
    bm.free(a)  # LRU after: 1, 0 (tail first)
    bm.free(b)  # LRU after: 1, 0, 3, 2
    rec.events.clear()
    table: list[int] = []
    assert bm.allocate(table, [], 9)  # needs 3 blocks: evicts 1, 0, 3 in LRU order
    assert table == [1, 0, 3]
    assert rec.events == [("removed", 1, ha[1]), ("removed", 0, ha[0]), ("removed", 3, hb[1])]
    # Block 2 (b's first block) is still cached and still a hit.
    assert bm.match_prefix([3, 3, 3, 3, 9], hb[:1], 4) == [2]
    bm.check_integrity()


def test_shortage_is_a_return_value_and_changes_nothing() -> None:
    bm = BlockManager(num_blocks=3, block_size=BS)
    a = _fill(bm, list(range(9)))  # 3 blocks
    table: list[int] = []
    assert not bm.can_allocate(table, [], 1)
    assert bm.allocate(table, [], 1) is False and table == []
    assert bm.may_append(a, 13) is False and a == [0, 1, 2]
    bm.check_integrity()


def test_hash_collision_is_not_served() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    bm.free(_fill(bm, [5, 6, 7, 8, 0]))
    h = block_hashes([5, 6, 7, 8], BS)
    # Same hash, different tokens (as a collision would look): a miss, never wrong KV.
    assert bm.lookup(h[0], [5, 6, 7, 9]) is None
    assert bm.match_prefix([5, 6, 7, 9, 1], h, 4) == []
    assert bm.lookup(h[0], [5, 6, 7, 8]) == 0


def test_duplicate_content_keeps_first_block_registered() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS)
    toks = [9, 9, 9, 9, 1]
    h = block_hashes(toks, BS)
    a: list[int] = []
    b: list[int] = []
    # Two requests computed the same block concurrently (neither was cached at admission).
    assert bm.allocate(a, [], 5) and bm.allocate(b, [], 5)
    assert (a, b) == ([0, 1], [2, 3])
    bm.cache_full_blocks(a, toks, h, 0)
    bm.cache_full_blocks(b, toks, h, 0)
    assert bm.blocks[0].block_hash == h[0] and bm.blocks[2].block_hash is None
    bm.free(b)
    assert list(bm._free)[-2:] == [3, 2]  # the twin is plainly free, not cached
    bm.free(a)
    bm.check_integrity()


def test_prefix_caching_disabled_never_hits() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    toks = list(range(9))
    bm.free(_fill(bm, toks))
    assert bm.num_cached_blocks == 0
    assert bm.match_prefix(toks, block_hashes(toks, BS), 8) == []
    bm.check_integrity()


# -- cached partial blocks ---------------------------------------------------------------------------


def _fill_partial(bm: BlockManager, tokens: list[int], extra: bytes = b"") -> list[int]:
    """``_fill``, then keep the trailing partial block as a cached partial block (as the scheduler
    does when the request is freed); returns the table (still in use)."""
    hashes = block_hashes(tokens, BS, extra)
    hits = bm.match_prefix(tokens, hashes, len(tokens) - 1)
    table: list[int] = []
    assert bm.allocate(table, hits, len(tokens))
    bm.cache_full_blocks(table, tokens, hashes, len(hits))
    k = len(tokens) // BS
    parent = (hashes[k - 1] if k else None, extra)
    assert bm.cache_partial_block(table[k], parent, tokens[k * BS :])
    return table


def test_partial_block_is_cached_on_free_and_found_by_an_extension() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS)
    toks = [10, 11, 12, 13, 14, 15]  # a full block and 2 computed tokens
    h = block_hashes(toks, BS)
    table = _fill_partial(bm, toks)
    assert table == [0, 1]
    bm.free(table)
    # Both stay cached (tail first in the LRU); the partial one has no hash.
    assert list(bm._cached) == [1, 0] and list(bm._free) == [2, 3, 4, 5]
    assert bm.num_partial_blocks == 1 and bm.blocks[1].block_hash is None
    assert bm.blocks[1].token_ids == (14, 15)
    # The longest cached prefix of the next block's tokens, capped at block_size - 1.
    assert bm.match_partial((h[0], b""), [14, 15, 16]) == (1, 2)
    assert bm.match_partial((h[0], b""), [14, 15]) == (1, 2)
    assert bm.match_partial((h[0], b""), [14]) is None  # shorter than the cached tokens
    # Tokens that diverge inside the block, another parent block, another salt: misses.
    assert bm.match_partial((h[0], b""), [14, 99, 16]) is None
    assert bm.match_partial((None, b""), [14, 15, 16]) is None
    assert bm.match_partial((h[0], b"salt"), [14, 15, 16]) is None
    bm.check_integrity()


def test_partial_first_block_is_keyed_by_the_salt() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    lora = b"lora\x00a\x00"
    bm.free(_fill_partial(bm, [7, 8], lora))
    bm.free(_fill_partial(bm, [7, 8, 9]))  # the same tokens without the adapter: its own block
    assert bm.match_partial((None, lora), [7, 8, 9, 5]) == (0, 2)
    assert bm.match_partial((None, b""), [7, 8, 9, 5]) == (1, 3)
    assert bm.match_partial((None, b"lora\x00b\x00"), [7, 8, 9, 5]) is None
    bm.check_integrity()


def test_pinned_partial_block_is_not_evicted_and_returns_to_the_lru() -> None:
    bm = BlockManager(num_blocks=3, block_size=BS)
    bm.free(_fill_partial(bm, [1, 2, 3]))  # block 0, cached partial
    bm.pin(0)
    assert bm.num_free_blocks == 2 and bm.blocks[0].ref_count == 1
    table: list[int] = []
    assert not bm.can_allocate(table, [], 9)  # 3 blocks: the pinned one is not available
    assert bm.allocate(table, [], 8) and table == [1, 2]
    assert bm.match_partial((None, b""), [1, 2, 3, 4]) == (0, 3)  # findable while pinned
    bm.check_integrity()
    bm.unpin(0)
    assert list(bm._cached) == [0] and bm.blocks[0].ref_count == 0
    bm.free(table)
    bm.check_integrity()


def test_partial_and_full_blocks_share_one_lru_and_partial_eviction_is_silent() -> None:
    bm = BlockManager(num_blocks=5, block_size=BS)
    rec = Recorder()
    bm.add_listener(rec)
    a = _fill_partial(bm, [1, 1, 1, 1, 2])  # 0 full, 1 partial
    b = _fill_partial(bm, [3, 3, 3, 3, 4, 4])  # 2 full, 3 partial
    ha = block_hashes([1, 1, 1, 1], BS)
    # Only full blocks are announced (so only they reach the KV tier and KV events).
    assert [e[:2] for e in rec.events] == [("stored", 0), ("stored", 2)]
    bm.free(a)  # LRU: 1, 0
    bm.free(b)  # LRU: 1, 0, 3, 2
    rec.events.clear()
    table: list[int] = []
    assert bm.allocate(table, [], 9)  # the free block 4 first, then LRU order: 1 (partial), 0 (full)
    assert table == [4, 1, 0]
    assert rec.events == [("removed", 0, ha[0])]  # the partial block's eviction fires nothing
    assert bm.match_partial((ha[0], b""), [2, 5]) is None  # its entry is forgotten
    assert bm.num_partial_blocks == 1 and list(bm._cached) == [3, 2]
    bm.check_integrity()
    assert bm.reset_prefix_cache() == 2
    assert bm.num_partial_blocks == 0
    bm.check_integrity()


def test_cache_partial_block_refusals() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    table = _fill(bm, [5, 6, 7, 8, 9])  # blocks 0 (full, registered), 1
    h = block_hashes([5, 6, 7, 8], BS)
    assert not bm.cache_partial_block(table[0], (None, b""), [5, 6, 7])  # registered full block
    assert not bm.cache_partial_block(table[1], (h[0], b""), [9, 1, 2, 3])  # full: not partial
    assert not bm.cache_partial_block(table[1], (h[0], b""), [])
    shared: list[int] = []
    assert bm.allocate(shared, [table[1]], 4) and bm.blocks[table[1]].ref_count == 2
    assert not bm.cache_partial_block(table[1], (h[0], b""), [9])  # shared by two tables
    bm.free(shared)
    assert bm.cache_partial_block(table[1], (h[0], b""), [9])
    # An equal partial block is already cached: the twin is plainly freed.
    twin: list[int] = []
    assert bm.allocate(twin, [], 1) and twin == [2]
    assert not bm.cache_partial_block(twin[0], (h[0], b""), [9])
    bm.free(twin)
    bm.free(table)
    assert list(bm._free)[-1] == 2 and list(bm._cached) == [1, 0]
    bm.check_integrity()
    off = BlockManager(num_blocks=4, block_size=BS, enable_partial_caching=False)
    t2 = _fill(off, [1, 2])
    assert not off.cache_partial_block(t2[0], (None, b""), [1, 2])
    assert not BlockManager(4, BS, enable_prefix_caching=False).enable_partial_caching
    off.free(t2)
    off.check_integrity()


def test_integrity_catches_a_stale_partial_entry() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    bm.free(_fill_partial(bm, [1, 2]))
    bm.blocks[0].token_ids = (1, 3)
    try:
        bm.check_integrity()
    except AssertionError:
        return
    raise AssertionError("check_integrity missed a partial map entry naming other tokens")
