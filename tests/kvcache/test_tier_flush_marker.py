"""A Redis flushed without a restart (``FLUSHALL`` / ``FLUSHDB``: same ``run_id``) is noticed by each
tier client's own marker key, and the replica re-publishes. Real redis-servers, real tiny Llama."""

from __future__ import annotations

import logging
import time

import pytest
import redis

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from kvcache.keys import block_hashes, tier_key
from kvcache.redis_tier import MARKER_PREFIX
from kvcache.tier import open_tier

BLOCK = 16
PROMPT = [(11 * i + 5) % 900 + 10 for i in range(5 * BLOCK)]  # 80 tokens: 5 full blocks
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
OPTIONS = {"block_size": BLOCK, "num_kv_blocks": 64, "deterministic": True}
QUICK = "?timeout=0.5&connect_timeout=0.5&flush_check=0.01"


def _markers(port: int) -> set[str]:
    return {k.decode() for k in redis.Redis(port=port).keys(MARKER_PREFIX + "*")}


def _check(tier) -> None:  # noqa: ANN001
    """One flush check: wait past the interval, start it as an engine step would, wait for it."""
    time.sleep(0.02)
    tier.poll()
    tier.inner.wait_for_probe(5.0)


def _check_until(tier, epoch: int) -> None:  # noqa: ANN001
    deadline = time.monotonic() + 10
    while tier.epoch() < epoch:
        assert time.monotonic() < deadline, "the flush went unnoticed"
        _check(tier)


@pytest.mark.parametrize("command", ["FLUSHALL", "FLUSHDB"])
def test_a_flush_moves_the_epoch_of_every_client_once(private_redis, command: str) -> None:
    srv = private_redis()
    a, b = open_tier(srv.url + QUICK), open_tier(srv.url + QUICK)
    assert a.put_many([("ferry:kv:fp:00", b"1")]) == [True]
    _check(a)
    _check(b)  # each sets a marker of its own
    assert len(_markers(srv.port)) == 2
    _check(a)
    assert (a.epoch(), b.epoch()) == (0, 0)  # found again: nothing lost
    redis.Redis(port=srv.port).execute_command(command)
    assert _markers(srv.port) == set()
    _check_until(a, 1)
    assert len(_markers(srv.port)) == 1  # a set its own again; b's is still gone...
    _check_until(b, 1)  # ... so b notices too (a marker shared by both would have hidden it)
    assert len(_markers(srv.port)) == 2
    for _ in range(3):
        _check(a)
        _check(b)
    assert (a.epoch(), b.epoch()) == (1, 1)  # once per flush
    assert a.inner.breaker.times_opened == 0 and a.available()
    a.close()
    b.close()


def test_a_restart_counts_once_although_the_marker_is_gone_too(private_redis) -> None:
    srv = private_redis()
    tier = open_tier(srv.url + QUICK)
    _check(tier)
    assert tier.epoch() == 0 and len(_markers(srv.port)) == 1
    srv.stop()
    srv.start()  # empty, another run_id
    _check_until(tier, 1)  # the check's new connection sees the run_id change first
    for _ in range(3):
        _check(tier)
    assert tier.epoch() == 1
    tier.close()


def test_a_server_refusing_the_marker_is_served_unwatched(private_redis, caplog) -> None:
    srv = private_redis()
    admin = redis.Redis(port=srv.port)
    # An ACL that allows the blocks' key space only (an operator's reasonable least privilege).
    admin.execute_command("ACL", "SETUSER", "blocks", "on", ">pw", "~ferry:kv:*", "+@all")
    caplog.set_level(logging.WARNING, logger="kvcache.redis_tier")
    tier = open_tier(f"redis://blocks:pw@127.0.0.1:{srv.port}/0{QUICK}")
    _check(tier)
    assert [r.getMessage() for r in caplog.records if "refuses the KV tier's flush marker" in r.getMessage()]
    assert not tier.inner.inner.watch_due()  # never asked again
    assert tier.put_many([("ferry:kv:fp:00", b"1")]) == [True]
    assert tier.contains_many(["ferry:kv:fp:00"]) == [True]
    admin.flushall()
    _check(tier)
    assert tier.epoch() == 0 and tier.available() and _markers(srv.port) == set()
    tier.close()


def test_a_flushed_tier_gets_the_prefix_cache_back(tiny_llama, private_redis, caplog) -> None:
    srv = private_redis()
    a = LLM(str(tiny_llama), kv_tier=srv.url + "?timeout=0.5&flush_check=0.05", **OPTIONS)
    connector = a.engine.connector
    out = a.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    assert connector.flush(10.0)
    expected = {tier_key(a.engine.model_fingerprint, h) for h in block_hashes(PROMPT, BLOCK)}
    assert len(expected) == 5
    admin = redis.Redis(port=srv.port)
    assert {k.decode() for k in admin.keys("ferry:kv:*")} == expected
    assert len(_markers(srv.port)) == 1  # set by the first step's check
    caplog.set_level(logging.INFO, logger="kvcache")
    admin.flushall()
    republisher = connector.republisher
    deadline = time.monotonic() + 20
    while not (republisher.passes == 1 and not republisher.active):
        assert time.monotonic() < deadline, "the flush went unnoticed"
        a.engine.step()  # idle: each waits at most TIER_IDLE_WAIT_S
    assert republisher.last_outcome == "done"
    assert connector.flush(10.0)
    assert {k.decode() for k in admin.keys("ferry:kv:*")} == expected
    assert connector.stats().blocks_republished == 5
    assert [r for r in caplog.records if "was flushed" in r.getMessage()]
    # Another replica loads the prefix again instead of computing it.
    b = LLM(str(tiny_llama), kv_tier=srv.url, **OPTIONS)
    again = b.generate([PROMPT], GREEDY)[0]
    assert again.outputs[0].token_ids == out and again.num_cached_tokens == 4 * BLOCK
    a.close()
    b.close()
