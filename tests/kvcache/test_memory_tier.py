"""memory:// tier: byte bound, exact LRU order, sharing by name; URL parsing and the registry."""

from __future__ import annotations

import threading

import pytest

from kvcache.memory_tier import MemoryTier
from kvcache.tier import MeteredTier, open_tier


def test_lru_eviction_order_and_byte_bound_exact() -> None:
    tier = open_tier("memory://?max_bytes=300")
    store = tier.inner.store
    assert tier.put_many([("a", b"A" * 100), ("b", b"B" * 100), ("c", b"C" * 100)]) == [True] * 3
    assert store.keys() == ["a", "b", "c"]
    assert tier.get_many(["a"]) == [b"A" * 100]  # a becomes most recent
    assert store.keys() == ["b", "c", "a"]
    assert tier.contains_prefix(["b", "c"]) == 2  # probing does not refresh recency
    assert store.keys() == ["b", "c", "a"]
    assert tier.put_many([("d", b"D" * 100)]) == [True]  # evicts b, the least recently used
    assert store.keys() == ["c", "a", "d"]
    s = tier.stats()
    assert (s.entries, s.bytes_used, s.capacity_bytes, s.evictions) == (3, 300, 300, 1)
    assert tier.put_many([("e", b"E" * 250)]) == [True]  # needs 250: evicts c, a, d in that order
    assert store.keys() == ["e"]
    assert tier.stats().bytes_used == 250 and tier.stats().evictions == 4
    assert tier.get_many(["a", "e", "zz"]) == [None, b"E" * 250, None]


def test_oversized_value_is_refused_and_evicts_nothing() -> None:
    tier = open_tier("memory://?max_bytes=300")
    tier.put_many([("a", b"x" * 200)])
    assert tier.put_many([("big", b"x" * 301)]) == [False]
    assert tier.inner.store.keys() == ["a"] and tier.stats().bytes_used == 200


def test_replacing_a_key_updates_bytes() -> None:
    tier = open_tier("memory://?max_bytes=1000")
    tier.put_many([("a", b"x" * 100), ("b", b"y" * 100)])
    tier.put_many([("a", b"z" * 300)])
    assert tier.inner.store.keys() == ["b", "a"]
    assert tier.stats().bytes_used == 400
    assert tier.get_many(["a"]) == [b"z" * 300]


def test_contains_prefix_counts_leading_keys_only() -> None:
    tier = open_tier("memory://")
    tier.put_many([("k0", b"0"), ("k1", b"1"), ("k3", b"3")])
    assert tier.contains_prefix(["k0", "k1", "k2", "k3"]) == 2
    assert tier.contains_prefix(["k2", "k0"]) == 0
    assert tier.contains_prefix([]) == 0
    assert tier.stats().capacity_bytes == 1 << 30  # default bound: 1 GiB


def test_hits_misses_and_bytes_are_counted(metric) -> None:
    tier = open_tier("memory://")
    before = {
        n: metric(f"ferry:kv_tier_{n}_total") for n in ("hits", "misses", "bytes_read", "bytes_written")
    }
    get_count = metric("ferry:kv_tier_get_seconds_count")
    tier.put_many([("a", b"x" * 10), ("b", b"y" * 20)])
    tier.get_many(["a", "b", "c"])
    assert metric("ferry:kv_tier_hits_total") - before["hits"] == 2
    assert metric("ferry:kv_tier_misses_total") - before["misses"] == 1
    assert metric("ferry:kv_tier_bytes_read_total") - before["bytes_read"] == 30
    assert metric("ferry:kv_tier_bytes_written_total") - before["bytes_written"] == 30
    assert metric("ferry:kv_tier_get_seconds_count") == get_count + 1
    s = tier.stats()
    assert (s.hits, s.misses, s.bytes_read, s.bytes_written, s.blocks_written) == (2, 1, 30, 30, 2)


def test_named_memory_tier_is_shared_in_process() -> None:
    a = open_tier("memory://shared-test?max_bytes=1000")
    b = open_tier("memory://shared-test?max_bytes=1000")
    a.put_many([("k", b"v")])
    assert b.get_many(["k"]) == [b"v"]
    with pytest.raises(ValueError, match="already open"):
        open_tier("memory://shared-test?max_bytes=5")
    a.close()
    assert b.get_many(["k"]) == [b"v"]  # still held by b
    assert a.get_many(["k"]) == [None]  # a closed tier answers misses
    b.close()
    c = open_tier("memory://shared-test?max_bytes=5")  # last user gone: a fresh store
    assert c.get_many(["k"]) == [None]
    c.close()
    private1, private2 = open_tier("memory://"), open_tier("memory://")
    private1.put_many([("k", b"v")])
    assert private2.get_many(["k"]) == [None]


def test_memory_tier_is_thread_safe_under_the_bound() -> None:
    tier = MemoryTier(max_bytes=50_000)

    def work(t: int) -> None:
        for i in range(300):
            tier.put_many([(f"{t}-{i}", bytes(1000))])
            tier.get_many([f"{t}-{i - 1}", f"{(t + 1) % 4}-{i}"])

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    s = tier.stats()
    assert s.entries == 50 and s.bytes_used == 50_000 and s.evictions == 4 * 300 - 50


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("nothing", "no scheme"),
        ("s3://bucket", "unknown KV tier scheme 's3'"),
        ("memory://?max_bytes=abc", "must be an integer"),
        ("memory://?max_bytes=0", "must be >= 1"),
        ("memory://?maxbytes=10", "unknown KV tier URL parameter"),
        ("memory://name/path", "takes no path"),
        ("redis://127.0.0.1:1/0?tll=5", "unknown KV tier URL parameter.*tll"),
        ("redis://127.0.0.1:1/0?timeout=-1", "must be >= 0.001"),
    ],
)
def test_bad_urls_are_rejected_at_open(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        open_tier(url)


def test_open_tier_wraps_in_metered_tier() -> None:
    tier = open_tier("memory://?max_bytes=10")
    assert isinstance(tier, MeteredTier) and isinstance(tier.inner, MemoryTier)
    assert tier.get_many([]) == [] and tier.put_many([]) == []
