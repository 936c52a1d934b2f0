"""Re-publication: blocks computed while the Redis tier was away are written once it is back.

Real tiny Llama, real redis-server (stopped and started again on its port, empty, as a crash and
restart leave it). Without re-publication the blocks stay in the replica's prefix cache only (they
hit there, so are never written again) and every other replica recomputes them.
"""

from __future__ import annotations

import logging
import time

import pytest
import redis

from engine.demo import build_model
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from kvcache.keys import block_hashes, tier_key

BLOCK = 16
PROMPT = [(7 * i + 3) % 900 + 10 for i in range(5 * BLOCK)]  # 80 tokens: 5 full blocks
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)  # 91 tokens with KV: still 5 full blocks
FOUR_PROMPTS = [[(p * 131 + 7 * i) % 900 + 10 for i in range(5 * BLOCK)] for p in range(4)]  # 20 blocks
OPTIONS = {"block_size": BLOCK, "num_kv_blocks": 64, "deterministic": True}
# Quick to notice an outage and to try again: one failure opens the breaker, 0.2 s cool-down.
TIER_PARAMS = "?timeout=0.5&connect_timeout=0.5&breaker_failures=1&breaker_cooldown=0.2"


@pytest.fixture(scope="module")
def other_llama(models_root):  # noqa: ANN001, ANN201
    """tiny_llama's shapes with other weights: a weight update to it changes the fingerprint."""
    return build_model(models_root / "republish_other_llama", "llama", seed=101)


def _keys_in(url: str) -> set[str]:
    return {k.decode() for k in redis.Redis.from_url(url).keys("ferry:kv:*")}


def _step_until(llm: LLM, done, timeout: float = 20.0) -> None:
    """Step an idle engine (each step waits at most TIER_IDLE_WAIT_S) until ``done()``."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        llm.engine.step()


def _reconnect(llm: LLM) -> None:
    """Ask the tier until its breaker closes (an arrival lookup does the same), stepping nothing."""
    kv = llm.engine.connector.kv
    guarded = kv.tier.inner
    deadline = time.monotonic() + 20.0
    while not kv.tier.available():
        assert time.monotonic() < deadline, "the breaker did not close"
        time.sleep(0.05)
        kv.lookup([bytes(16)])  # after the cool-down: starts the probe
        guarded.wait_for_probe(5.0)


def _generate(llm: LLM, prompt: list[int] = PROMPT) -> tuple[list[int], int]:
    out = llm.generate([prompt], GREEDY)[0]
    return out.outputs[0].token_ids, out.num_cached_tokens


def _outage_then_first_step(llm: LLM, srv, caplog) -> list[list[int]]:  # noqa: ANN001
    """Compute FOUR_PROMPTS' 20 blocks while Redis is down (none written), bring it back empty and
    step until a pass, 2 blocks per step and 4 keys per existence check, queued its first 2 blocks.
    Returns the prompts' outputs."""
    republisher = llm.engine.connector.republisher
    republisher.blocks_per_step = 2
    republisher.check_chunk = 4
    srv.stop()
    outputs = [_generate(llm, p)[0] for p in FOUR_PROMPTS]
    srv.start()
    caplog.set_level(logging.INFO, logger="kvcache.republish")
    _reconnect(llm)
    _step_until(llm, lambda: republisher.queued >= 2)
    return outputs


def test_blocks_computed_while_redis_was_down_are_republished(
    tiny_llama, private_redis, metric, caplog
) -> None:
    srv = private_redis()
    url = srv.url + TIER_PARAMS
    a = LLM(str(tiny_llama), kv_tier=url, **OPTIONS)
    connector = a.engine.connector
    fingerprint = a.engine.model_fingerprint
    before = metric("ferry:kv_tier_republished_blocks_total")

    srv.stop()
    tokens, cached = _generate(a)  # computed while Redis is down: every write dropped
    assert cached == 0
    assert connector.flush(10.0)
    assert connector.stats().blocks_saved == 0
    srv.start()  # same port, empty
    assert _keys_in(srv.url) == set()
    # Past the breaker's cool-down: a write's failed probe may have opened it again just now, and
    # a lookup inside the cool-down answers a miss without probing (nothing else would probe).
    time.sleep(0.3)

    # The same prompt hits A's own prefix cache; its arrival lookup probes the tier, which closes
    # the breaker: a pass starts and writes the 5 blocks the tier lacks.
    caplog.set_level(logging.INFO, logger="kvcache.republish")
    assert _generate(a) == (tokens, 4 * BLOCK)
    republisher = connector.republisher
    _step_until(a, lambda: republisher.passes >= 1 and not republisher.active)
    assert connector.flush(10.0)
    assert republisher.last_outcome == "done"
    expected = {tier_key(fingerprint, h) for h in block_hashes(PROMPT, BLOCK)}
    assert len(expected) == 5
    assert _keys_in(srv.url) == expected
    assert connector.stats().blocks_republished == 5
    assert metric("ferry:kv_tier_republished_blocks_total") - before == 5
    lines = [r.getMessage() for r in caplog.records if "re-publication pass" in r.getMessage()]
    assert lines and "5 lacked by the tier, 5 queued for writing" in lines[-1]

    # Another replica now loads the prefix instead of recomputing it.
    b = LLM(str(tiny_llama), kv_tier=url, **OPTIONS)
    assert _generate(b) == (tokens, 4 * BLOCK)
    assert b.engine.connector.stats().blocks_loaded == 4
    a.close()
    b.close()


def test_a_quick_restart_is_noticed_without_the_breaker_opening(tiny_llama, private_redis) -> None:
    srv = private_redis()
    url = srv.url + "?timeout=0.5&connect_timeout=0.5"
    a = LLM(str(tiny_llama), kv_tier=url, **OPTIONS)
    connector = a.engine.connector
    tokens, _ = _generate(a)
    assert connector.flush(10.0) and len(_keys_in(srv.url)) == 5

    srv.stop()
    srv.start()  # empty; A made no call meanwhile, so nothing failed
    assert _keys_in(srv.url) == set()
    assert _generate(a) == (tokens, 4 * BLOCK)  # its lookup reconnects and sees a new run_id
    republisher = connector.republisher
    _step_until(a, lambda: republisher.passes >= 1 and not republisher.active)
    assert connector.flush(10.0)
    guarded = connector.kv.tier.inner
    assert guarded.breaker.times_opened == 0
    fingerprint = a.engine.model_fingerprint
    assert _keys_in(srv.url) == {tier_key(fingerprint, h) for h in block_hashes(PROMPT, BLOCK)}
    assert connector.stats().blocks_republished == 5
    a.close()


def test_a_pass_stops_cleanly_when_the_tier_fails_again(tiny_llama, private_redis, caplog) -> None:
    srv = private_redis()
    url = srv.url + TIER_PARAMS
    a = LLM(str(tiny_llama), kv_tier=url, **OPTIONS)
    connector = a.engine.connector
    republisher = connector.republisher
    outputs = _outage_then_first_step(a, srv, caplog)  # one step's budget queued: 18 blocks to go
    assert republisher.active and republisher.queued == 2
    assert connector.flush(10.0) and connector.stats().blocks_republished == 2
    srv.stop()
    _step_until(a, lambda: not republisher.active)
    assert republisher.last_outcome is not None and republisher.last_outcome.startswith("stopped")
    line = [r for r in caplog.records if "re-publication pass" in r.getMessage()][-1]
    assert line.levelno == logging.WARNING and "of 20 prefix-cache blocks checked" in line.getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert connector.flush(10.0)
    assert connector.stats().blocks_republished == 2
    # The engine serves on, from its own prefix cache, with the tier down.
    assert _generate(a, FOUR_PROMPTS[1]) == (outputs[1], 4 * BLOCK)
    a.engine.block_manager.check_integrity()
    a.close()


def test_blocks_evicted_locally_during_a_pass_are_skipped(tiny_llama, private_redis, caplog) -> None:
    srv = private_redis()
    a = LLM(str(tiny_llama), kv_tier=srv.url + TIER_PARAMS, **OPTIONS)
    connector = a.engine.connector
    republisher = connector.republisher
    _outage_then_first_step(a, srv, caplog)  # blocks 0, 1 queued; 2, 3 next; 4..7 asked
    # Every cached block goes: the 20 full ones and the 4 requests' partly filled last ones.
    assert a.engine.block_manager.reset_prefix_cache() == 24
    _step_until(a, lambda: not republisher.active)
    assert republisher.last_outcome == "done"
    line = [r.getMessage() for r in caplog.records if "re-publication pass" in r.getMessage()][-1]
    assert "8 of 20 prefix-cache blocks checked, 8 lacked by the tier, 2 queued for writing" in line
    assert "18 evicted locally first" in line
    assert connector.flush(10.0)
    hashes = block_hashes(FOUR_PROMPTS[0], BLOCK)[:2]
    assert _keys_in(srv.url) == {tier_key(a.engine.model_fingerprint, h) for h in hashes}
    a.close()


@pytest.mark.parametrize("event", ["weights", "sleep"])
def test_a_pass_is_cancelled_when_the_kv_cache_or_weights_change(
    tiny_llama, other_llama, private_redis, event: str
) -> None:
    srv = private_redis()
    url = srv.url + TIER_PARAMS
    a = LLM(str(tiny_llama), kv_tier=url, enable_sleep_mode=True, **OPTIONS)
    connector = a.engine.connector
    republisher = connector.republisher
    republisher.blocks_per_step = 1
    old = a.engine.model_fingerprint
    srv.stop()
    _generate(a)
    srv.start()
    _reconnect(a)
    _step_until(a, lambda: republisher.queued >= 1)
    assert republisher.active
    if event == "sleep":
        a.sleep(1)
    else:
        a.reload_weights(str(other_llama))
        assert a.engine.model_fingerprint != old
    assert not republisher.active and republisher.last_outcome.startswith("cancelled")
    if event == "sleep":
        a.wake_up()
    for _ in range(20):  # steps after it start nothing: the tier did not come back again
        a.engine.step()
    assert not republisher.has_work() and republisher.passes == 1
    assert connector.flush(10.0)
    # Nothing was ever written under another fingerprint than the one it was computed under.
    assert all(k.startswith(f"ferry:kv:{old}:") for k in _keys_in(srv.url))
    assert len(_keys_in(srv.url)) == 1  # the one block queued before it ended
    a.close()


async def test_an_idle_async_engine_finishes_the_pass(tiny_llama, private_redis) -> None:
    import asyncio

    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig

    srv = private_redis()
    eng = AsyncEngine(EngineConfig(model=str(tiny_llama), kv_tier=srv.url + TIER_PARAMS, **OPTIONS))
    republisher = eng.engine.connector.republisher
    republisher.blocks_per_step = 1  # a request's dozen steps cannot finish a pass of 20 blocks

    async def run(rid: str, prompt: list[int]) -> None:
        async for _ in eng.generate(rid, prompt, GREEDY):
            pass

    try:
        srv.stop()
        for i, prompt in enumerate(FOUR_PROMPTS):
            await run(f"down-{i}", prompt)
        srv.start()
        await asyncio.sleep(0.3)  # past the breaker's cool-down: the next lookup probes
        await run("back", FOUR_PROMPTS[0])  # a local prefix hit; its arrival lookup closes the breaker
        assert republisher.has_work()
        fingerprint = eng.engine.model_fingerprint
        expected = {tier_key(fingerprint, h) for p in FOUR_PROMPTS for h in block_hashes(p, BLOCK)}
        assert len(expected) == 20
        deadline = time.monotonic() + 20
        while _keys_in(srv.url) != expected:  # no request runs: the idle loop carries the pass on
            assert time.monotonic() < deadline, f"{len(_keys_in(srv.url))} of 20 blocks re-published"
            await asyncio.sleep(0.05)
        assert eng.engine.connector.stats().blocks_republished == 20
    finally:
        await asyncio.wait_for(eng.shutdown(), 30)
