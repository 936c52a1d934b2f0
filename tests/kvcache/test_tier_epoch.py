"""The tier's signals for re-publication: ``epoch()`` (the tier may have lost this process's writes),
``contains_many`` (which keys other processes can read) and ``available()``. Real redis-servers."""

from __future__ import annotations

import logging
import time

import redis

from kvcache.breaker import CircuitBreaker
from kvcache.memory_tier import MemoryTier
from kvcache.tier import open_tier

QUICK = "?timeout=0.5&connect_timeout=0.5&breaker_failures=1&breaker_cooldown=0.1"


def _probe_until_available(tier, guarded) -> None:  # noqa: ANN001
    deadline = time.monotonic() + 10
    while not tier.available():
        assert time.monotonic() < deadline, "the breaker did not close"
        time.sleep(0.15)
        tier.contains_prefix(["k"])  # after the cool-down: starts the probe
        guarded.wait_for_probe(5.0)


def test_contains_many_flags_each_key_and_is_none_when_down(private_redis) -> None:
    srv = private_redis()
    tier = open_tier(srv.url + QUICK)
    assert tier.put_many([("a", b"1"), ("c", b"3")]) == [True, True]
    assert tier.contains_many(["a", "b", "c"]) == [True, False, True]
    assert tier.contains_many([]) == []
    srv.stop()
    assert tier.contains_many(["a"]) is None  # down: no answer, not "absent"
    assert not tier.available()  # one failure opened the breaker
    assert tier.contains_many(["a"]) is None
    tier.close()


def test_a_composite_tier_answers_for_its_shared_level(private_redis) -> None:
    srv = private_redis()
    tier = open_tier(srv.url + QUICK + "&l1_bytes=1048576")
    assert tier.put_many([("a", b"1"), ("b", b"2")]) == [True, True]
    redis.Redis(port=srv.port).delete("b")  # L1 still holds it; another replica could not read it
    assert tier.contains_prefix(["a", "b"]) == 2
    assert tier.contains_many(["a", "b"]) == [True, False]
    tier.close()


def test_a_restart_moves_the_epoch_once_even_without_the_breaker_opening(private_redis) -> None:
    srv = private_redis()
    tier = open_tier(srv.url + "?timeout=0.5&connect_timeout=0.5")
    assert tier.epoch() == 0
    assert tier.contains_many(["a"]) == [False]  # the first connection: the run_id is learnt
    assert tier.epoch() == 0
    srv.stop()
    srv.start()
    # The pooled connection is found closed and replaced: the new one sees another run_id.
    assert tier.contains_many(["a"]) == [False]
    assert tier.epoch() == 1
    assert tier.inner.breaker.times_opened == 0
    assert tier.contains_many(["a"]) == [False] and tier.epoch() == 1
    tier.close()


def test_a_breaker_that_closes_after_an_outage_moves_the_epoch(private_redis) -> None:
    srv = private_redis()
    tier = open_tier(srv.url + QUICK)
    guarded = tier.inner
    assert tier.contains_many(["a"]) == [False] and tier.epoch() == 0
    srv.stop()
    assert tier.put_many([("a", b"1")]) == [False]
    assert not tier.available() and tier.epoch() == 0
    srv.start()
    _probe_until_available(tier, guarded)
    # The breaker's close (1) and the server's new run_id (1).
    assert guarded.breaker.recoveries == 1 and tier.epoch() == 2
    tier.close()


def test_a_server_refusing_info_is_served_unwatched(private_redis, caplog) -> None:
    srv = private_redis()
    admin = redis.Redis(port=srv.port)
    admin.execute_command("ACL", "SETUSER", "noinfo", "on", ">pw", "~*", "+@all", "-info")
    caplog.set_level(logging.WARNING, logger="kvcache.redis_tier")
    tier = open_tier(f"redis://noinfo:pw@127.0.0.1:{srv.port}/0?timeout=0.5")
    assert tier.put_many([("a", b"1")]) == [True]
    assert tier.contains_many(["a", "b"]) == [True, False]
    assert tier.epoch() == 0 and tier.available()
    assert [r.getMessage() for r in caplog.records if "refuses INFO" in r.getMessage()]
    tier.close()


def test_a_memory_tier_never_loses_writes() -> None:
    tier = MemoryTier(1 << 20)
    tier.put_many([("a", b"1")])
    assert tier.contains_many(["a", "b"]) == [True, False]
    assert tier.epoch() == 0 and tier.available()


def test_breaker_counts_recoveries_only_after_an_open() -> None:
    b = CircuitBreaker(failure_threshold=1, cooldown_s=0.0)
    b.record_success()
    assert b.recoveries == 0
    b.record_failure()
    assert b.state == "open"
    b.record_success()
    assert b.state == "closed" and b.recoveries == 1
    b.record_success()
    assert b.recoveries == 1
