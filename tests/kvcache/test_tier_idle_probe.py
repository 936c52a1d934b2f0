"""An idle replica whose tier breaker is open probes the tier from its idle step, so the breaker
closes and the re-publication pass runs with no traffic. Real redis-servers, real tiny Llama."""

from __future__ import annotations

import asyncio
import time

import redis

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from kvcache.breaker import CircuitBreaker, GuardedTier
from kvcache.keys import block_hashes, tier_key
from kvcache.metrics import ERROR_CIRCUIT_OPEN, ERROR_CONNECTION
from kvcache.redis_tier import RedisTier

BLOCK = 16
PROMPT = [(3 * i + 17) % 900 + 10 for i in range(5 * BLOCK)]  # 80 tokens: 5 full blocks
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
OPTIONS = {"block_size": BLOCK, "num_kv_blocks": 64, "deterministic": True}
# One failure opens the breaker, 0.2 s cool-down; no flush checks (they are another test's).
TIER_PARAMS = "?timeout=0.5&connect_timeout=0.5&breaker_failures=1&breaker_cooldown=0.2&flush_check=0"


def _keys_in(port: int) -> set[str]:
    return {k.decode() for k in redis.Redis(port=port).keys("ferry:kv:*")}


def test_poll_probes_an_open_breaker_once_per_cooldown(private_redis) -> None:
    srv = private_redis()
    now = [0.0]
    breaker = CircuitBreaker(failure_threshold=1, cooldown_s=10.0, clock=lambda: now[0])
    tier = GuardedTier(RedisTier(srv.url, socket_timeout=0.5, connect_timeout=0.5, flush_check_s=0), breaker)
    assert tier.contains_many(["a"]) == [False]  # the server's run_id is learnt
    srv.stop()
    assert tier.contains_many(["a"]) is None and breaker.state == "open"  # opened at t=0
    for _ in range(5):
        tier.poll()  # inside the cool-down: nothing
    assert breaker.state == "open" and breaker.times_opened == 1
    now[0] = 10.0
    for _ in range(5):
        tier.poll()  # the first starts the one probe; the others find it out (or failed: cooling down)
        tier.wait_for_probe(5.0)
    assert breaker.state == "open" and breaker.times_opened == 2  # one probe, failed: open again
    srv.start()  # empty, another run_id
    now[0] = 19.0
    tier.poll()
    tier.wait_for_probe(5.0)
    assert breaker.state == "open" and breaker.times_opened == 2
    now[0] = 20.0
    tier.poll()
    tier.wait_for_probe(5.0)
    assert breaker.state == "closed" and breaker.recoveries == 1
    assert tier.epoch() == 2  # the close, and the server's new run_id (seen by the probe)
    # Polls are no calls: none counts as skipped by the open breaker.
    errors = tier.stats().errors
    assert errors.get(ERROR_CIRCUIT_OPEN, 0) == 0 and errors[ERROR_CONNECTION] == 2
    tier.close()


async def test_an_idle_engine_probes_the_tier_and_republishes(tiny_llama, private_redis) -> None:
    srv = private_redis()
    eng = AsyncEngine(EngineConfig(model=str(tiny_llama), kv_tier=srv.url + TIER_PARAMS, **OPTIONS))
    connector = eng.engine.connector
    tier = connector.kv.tier
    try:
        srv.stop()
        async for _ in eng.generate("down", PROMPT, GREEDY):  # its writes are dropped
            pass
        assert connector.flush(10.0) and connector.stats().blocks_saved == 0
        assert not tier.available()
        srv.start()  # empty; from here on no request arrives
        expected = {tier_key(eng.engine.model_fingerprint, h) for h in block_hashes(PROMPT, BLOCK)}
        assert len(expected) == 5
        deadline = time.monotonic() + 20
        while _keys_in(srv.port) != expected:
            assert time.monotonic() < deadline, f"{len(_keys_in(srv.port))} of 5 blocks re-published"
            await asyncio.sleep(0.05)
        assert tier.available()
        republisher = connector.republisher
        while republisher.active:
            assert time.monotonic() < deadline, "the pass did not end"
            await asyncio.sleep(0.05)
        assert republisher.last_outcome == "done"
        assert connector.stats().blocks_republished == 5
        # The breaker is closed and the pass is over: the idle loop sleeps again (no idle work).
        assert not eng.engine.has_idle_work
    finally:
        await asyncio.wait_for(eng.shutdown(), 30)
