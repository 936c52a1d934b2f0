"""redis:// tier against a real redis-server: exact contents, key isolation, TTL, L1, outages."""

from __future__ import annotations

import time

import pytest
import redis

from kvcache.keys import block_hashes, tier_key
from kvcache.redis_tier import EXISTS_CHUNK, READ_CHUNK
from kvcache.tier import open_tier

HASHES = block_hashes(list(range(16 * 200)), 16)


def _items(fp: str, idx: list[int], size: int = 1000) -> list[tuple[str, bytes]]:
    return [(tier_key(fp, HASHES[i]), bytes([i % 256]) * size) for i in idx]


def test_put_get_contains_exact(redis_url: str) -> None:
    tier = open_tier(redis_url)
    items = _items("fpA", [0, 1, 2, 4])
    assert tier.put_many(items) == [True] * 4
    raw = redis.Redis.from_url(redis_url)
    # Stored exactly under ferry:kv:{fingerprint}:{hash_hex}, value byte for byte.
    assert raw.get(f"ferry:kv:fpA:{HASHES[1].hex()}") == bytes([1]) * 1000
    assert sorted(raw.keys("*")) == sorted(k.encode() for k, _ in items)
    keys = [tier_key("fpA", h) for h in HASHES[:6]]
    assert tier.contains_prefix(keys) == 3
    assert tier.contains_prefix(keys[4:]) == 1
    assert tier.contains_prefix(keys[3:]) == 0
    assert tier.get_many(keys) == [
        bytes([0]) * 1000,
        bytes([1]) * 1000,
        bytes([2]) * 1000,
        None,
        bytes([4]) * 1000,
        None,
    ]
    s = tier.stats()
    assert (s.hits, s.misses, s.bytes_written, s.breaker_state, s.errors) == (4, 2, 4000, "closed", {})
    tier.close()


def test_long_prefixes_cross_chunk_boundaries(redis_url: str) -> None:
    n = max(READ_CHUNK, EXISTS_CHUNK) * 2 + 7
    tier = open_tier(redis_url)
    tier.put_many(_items("fp", list(range(n)), size=64))
    keys = [tier_key("fp", h) for h in HASHES[: n + 3]]
    assert tier.contains_prefix(keys) == n
    values = tier.get_many(keys)
    assert values[:n] == [bytes([i % 256]) * 64 for i in range(n)] and values[n:] == [None] * 3
    redis.Redis.from_url(redis_url).delete(keys[EXISTS_CHUNK + 5])
    assert tier.contains_prefix(keys) == EXISTS_CHUNK + 5


def test_pipelined_exists_fallback_matches_the_script(redis_url: str) -> None:
    from kvcache.redis_tier import RedisTier

    tier = open_tier(redis_url)
    tier.put_many(_items("fp", [i for i in range(EXISTS_CHUNK + 10) if i != EXISTS_CHUNK + 3]))
    keys = [tier_key("fp", h) for h in HASHES[: EXISTS_CHUNK + 10]]
    scripted, pipelined = RedisTier(redis_url), RedisTier(redis_url, use_script=False)
    for sub in (keys, keys[:5], keys[EXISTS_CHUNK + 3 :], keys[EXISTS_CHUNK + 4 :]):
        assert scripted.contains_prefix(sub) == pipelined.contains_prefix(sub)
    assert pipelined.contains_prefix(keys) == EXISTS_CHUNK + 3
    assert pipelined.contains_prefix(keys[EXISTS_CHUNK + 4 :]) == 6


def test_other_fingerprint_never_reads_our_blocks(redis_url: str) -> None:
    tier = open_tier(redis_url)
    tier.put_many(_items("modelA", [0, 1]))
    other = [tier_key("modelB", h) for h in HASHES[:2]]
    assert tier.contains_prefix(other) == 0
    assert tier.get_many(other) == [None, None]


def test_ttl_is_applied(redis_url: str) -> None:
    tier = open_tier(redis_url + "?ttl=30")
    tier.put_many(_items("fp", [0]))
    raw = redis.Redis.from_url(redis_url)
    assert 0 < raw.ttl(tier_key("fp", HASHES[0])) <= 30
    plain = open_tier(redis_url)
    plain.put_many(_items("fp", [1]))
    assert raw.ttl(tier_key("fp", HASHES[1])) == -1  # no TTL: Redis' maxmemory policy evicts


def test_a_read_starts_a_blocks_ttl_again(redis_url: str) -> None:
    """``ttl`` is an idle time: a hot prefix read again and again does not expire every ttl seconds
    (each replica would recompute it); a read of a missing block creates nothing."""
    tier = open_tier(redis_url + "?ttl=30")
    tier.put_many(_items("fp", [0, 1]))
    raw = redis.Redis.from_url(redis_url)
    keys = [tier_key("fp", h) for h in HASHES[:3]]
    for key in keys[:2]:
        raw.pexpire(key, 2000)  # as if written 28 s ago
    values = tier.get_many(keys)
    assert [v is not None for v in values] == [True, True, False]
    assert tier.inner.inner.wait_touched()  # MeteredTier -> GuardedTier -> RedisTier
    assert all(28_000 < raw.pttl(key) <= 30_000 for key in keys[:2])
    assert raw.exists(keys[2]) == 0
    many = [tier_key("fp", i.to_bytes(16, "big")) for i in range(300)]  # several read chunks
    assert tier.get_many(many) == [None] * 300


def test_l1_in_front_of_redis(redis_url: str) -> None:
    tier = open_tier(redis_url + "?l1_bytes=100000")
    writer = open_tier(redis_url)  # another replica, writing only to Redis
    writer.put_many(_items("fp", [0, 1, 2]))
    keys = [tier_key("fp", h) for h in HASHES[:4]]
    assert tier.stats().entries == 0
    assert tier.get_many(keys[:2]) == [bytes([0]) * 1000, bytes([1]) * 1000]
    assert tier.stats().entries == 2  # L2 hits were promoted into L1
    raw = redis.Redis.from_url(redis_url)
    raw.delete(keys[0], keys[1])
    assert tier.get_many(keys[:2]) == [bytes([0]) * 1000, bytes([1]) * 1000]  # served by L1
    # contains_prefix merges both levels: 0,1 only in L1, 2 only in Redis.
    assert tier.contains_prefix(keys) == 3
    tier.put_many(_items("fp", [3]))  # writes reach both levels
    assert raw.exists(keys[3]) == 1
    assert tier.inner.l1.store.keys() == [keys[0], keys[1], keys[3]]  # probing promoted nothing


@pytest.fixture
def secured_redis(private_redis) -> int:
    """A second private redis-server that requires a password; its port."""
    return private_redis(password="s3cret").port


def test_password_in_url(secured_redis: int, metric) -> None:
    good = open_tier(f"redis://:s3cret@127.0.0.1:{secured_redis}/0")
    assert good.put_many(_items("fp", [0])) == [True]
    key = tier_key("fp", HASHES[0])
    assert good.get_many([key]) == [bytes([0]) * 1000]
    before = metric("ferry:kv_tier_errors_total", kind="response")
    bad = open_tier(f"redis://:wrong@127.0.0.1:{secured_redis}/0")
    assert bad.get_many([key]) == [None]  # a miss, never an exception
    assert metric("ferry:kv_tier_errors_total", kind="response") == before + 1
    assert bad.stats().errors == {"response": 1}


def test_a_full_redis_refuses_writes_and_still_serves_reads(private_redis, metric, caplog) -> None:
    # Redis at maxmemory under noeviction answers writes with OOM: the server is reachable, so the
    # refusals are counted and logged (once) but open no breaker, and reads go on hitting.
    url = private_redis().url
    tier = open_tier(url + "?breaker_failures=2&breaker_cooldown=60")
    items = _items("fp", [0, 1, 2])
    keys = [k for k, _ in items]
    assert tier.put_many(items) == [True] * 3
    raw = redis.Redis.from_url(url)
    raw.config_set("maxmemory-policy", "noeviction")
    raw.config_set("maxmemory", 1)
    before = metric("ferry:kv_tier_errors_total", kind="response")
    with caplog.at_level("WARNING", logger="kvcache.breaker"):
        for i in range(3, 8):  # refusals in a row (as a busy writer thread meets them)
            assert tier.put_many(_items("fp", [i])) == [False]
        assert tier.get_many(keys) == [v for _, v in items]  # reads still hit
    assert metric("ferry:kv_tier_errors_total", kind="response") == before + 5
    assert tier.stats().breaker_state == "closed"
    assert tier.stats().errors == {"response": 5}
    refusals = [r for r in caplog.records if "refused by the server" in r.getMessage()]
    assert len(refusals) == 1 and "maxmemory" in refusals[0].getMessage()
    assert raw.dbsize() == 3


def test_redis_outage_returns_misses_fast_and_recovers(redis_server, redis_url: str, metric) -> None:
    # A cool-down no stall of a loaded machine outlasts: it ends when the test ends it, below.
    tier = open_tier(redis_url + "?breaker_failures=2&breaker_cooldown=3600&timeout=0.5&connect_timeout=0.5")
    breaker = tier.inner.breaker
    items = _items("fp", [0, 1])
    keys = [k for k, _ in items]
    assert tier.put_many(items) == [True, True]
    assert tier.get_many(keys) == [v for _, v in items]
    conn_errors = metric("ferry:kv_tier_errors_total", kind="connection")
    open_skips = metric("ferry:kv_tier_errors_total", kind="circuit_open")
    redis_server.stop()
    try:
        for _ in range(2):  # two real failures open the breaker
            start = time.monotonic()
            assert tier.get_many(keys) == [None, None]
            assert time.monotonic() - start < 30  # bounded by the socket timeouts, never a hang
        assert metric("ferry:kv_tier_errors_total", kind="connection") == conn_errors + 2
        assert tier.stats().breaker_state == "open"
        # Open breaker: answers without touching the network (no connection error more).
        assert tier.contains_prefix(keys) == 0
        assert tier.put_many(items) == [False, False]
        assert tier.get_many(keys) == [None, None]
        assert metric("ferry:kv_tier_errors_total", kind="circuit_open") == open_skips + 3
        assert metric("ferry:kv_tier_errors_total", kind="connection") == conn_errors + 2
        breaker.cooldown_s = 0.0  # cool-down over: the next call (a miss at once) sends a background probe
        assert tier.get_many(keys) == [None, None]
        tier.inner.wait_for_probe(60.0)
        assert tier.stats().breaker_state == "open"  # the probe failed: open for another cool-down
        assert metric("ferry:kv_tier_errors_total", kind="connection") == conn_errors + 3
    finally:
        redis_server.start()
    # Another replica repopulates the (restarted, empty) Redis; ours recovers by itself.
    redis.Redis.from_url(redis_url).mset(dict(items))
    deadline = time.monotonic() + 60
    while tier.get_many(keys) != [v for _, v in items]:
        assert time.monotonic() < deadline, "tier did not recover after Redis came back"
        time.sleep(0.05)
    assert tier.stats().breaker_state == "closed"
    assert tier.contains_prefix(keys) == 2


def test_l1_keeps_serving_while_redis_is_down(redis_server, redis_url: str) -> None:
    tier = open_tier(redis_url + "?l1_bytes=100000&breaker_failures=1&breaker_cooldown=60")
    items = _items("fp", [0, 1])
    tier.put_many(items)
    redis_server.stop()
    try:
        keys = [k for k, _ in items] + [tier_key("fp", HASHES[2])]
        assert tier.get_many(keys) == [items[0][1], items[1][1], None]
        assert tier.contains_prefix(keys) == 2
        assert tier.stats().breaker_state == "open"
    finally:
        redis_server.start()


def test_rediss_speaks_tls_and_fails_safely_against_a_plain_server(redis_server, redis_url: str) -> None:
    tier = open_tier(
        f"rediss://127.0.0.1:{redis_server.port}/0?timeout=0.5&connect_timeout=0.5&ssl_cert_reqs=none"
    )
    start = time.monotonic()
    assert tier.get_many([tier_key("fp", HASHES[0])]) == [None]
    assert time.monotonic() - start < 30  # bounded by the socket timeout, never a hang
    # The plain server never answers the TLS ClientHello: the socket timeout ends it, as a miss.
    assert tier.stats().errors == {"timeout": 1}
    tier.close()
