"""PrefixIndex: longest held prefix per replica, exact removals, LRU bound, slot reuse."""

from __future__ import annotations

from kvcache.keys import block_hashes
from router.prefix_index import PrefixIndex


def test_match_counts_leading_blocks_per_replica() -> None:
    idx = PrefixIndex(100)
    hs = block_hashes(list(range(80)), 16)  # 5 blocks
    idx.insert(hs[:2], "a")
    idx.insert(hs[:4], "b")
    assert idx.match(hs, ["a", "b", "c"]) == {"a": 2, "b": 4, "c": 0}
    idx.remove(hs[1:2], "b")  # b evicted block 1: its usable prefix stops at block 0
    assert idx.match(hs, ["a", "b"]) == {"a": 2, "b": 1}
    idx.check_integrity()


def test_lru_bound_evicts_least_recently_used() -> None:
    idx = PrefixIndex(4)
    one = block_hashes(list(range(32)), 16)
    two = block_hashes(list(range(100, 132)), 16)
    idx.insert(one, "a")
    idx.insert(two, "b")
    assert len(idx) == 4
    idx.match(one, ["a"])  # touch `one`: `two` is now the oldest
    idx.insert(block_hashes(list(range(200, 216)), 16), "c")
    assert len(idx) == 4 and idx.evictions == 1
    assert idx.match(two, ["b"]) == {"b": 0}  # two[0] was evicted, so b's prefix is empty
    assert idx.match(one, ["a"]) == {"a": 2}
    idx.check_integrity()


def test_drop_replica_frees_its_slot_for_reuse() -> None:
    idx = PrefixIndex(100)
    hs = block_hashes(list(range(48)), 16)
    idx.insert(hs, "a")
    idx.insert(hs[:1], "b")
    idx.drop_replica("a")
    assert idx.holders(hs[0]) == {"b"}
    assert len(idx) == 1  # blocks only a held are gone
    idx.insert(hs, "c")  # takes a's freed slot
    assert idx.match(hs, ["a", "b", "c"]) == {"a": 0, "b": 1, "c": 3}
    idx.check_integrity()
