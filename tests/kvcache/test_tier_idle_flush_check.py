"""An idle replica keeps its Redis tier's flush check on schedule: a ``FLUSHALL`` (or a restart too
quick to open the breaker) is noticed and the prefix cache re-published with no request arriving.

Before, the flush check ran only from an engine step: an idle ``AsyncEngine`` (breaker closed, no
pass) slept on its condition with no timeout, so the blocks stayed lost to every other replica until
this one's next request. Now the loop sleeps until the check is due (``Tier.poll_due_in``), runs
it off the engine thread, and sleeps again: no busy wait, and nothing at all with checks off.
Real redis-server, real tiny Llama.
"""

from __future__ import annotations

import asyncio
import time

import redis

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from kvcache.keys import block_hashes, tier_key

BLOCK = 16
PROMPT = [(11 * i + 5) % 900 + 10 for i in range(5 * BLOCK)]  # 80 tokens: 5 full blocks
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
OPTIONS = {"block_size": BLOCK, "num_kv_blocks": 64, "deterministic": True}
CHECK_S = 0.3


def _block_keys(port: int, fingerprint: str) -> set[str]:
    return {k.decode() for k in redis.Redis(port=port).keys(f"ferry:kv:{fingerprint}:*")}


def _count_steps(connector) -> list[int]:  # noqa: ANN001
    """Wraps the connector's ``step`` (an engine or idle step) with a counter."""
    calls = [0]
    step = connector.step

    def counted() -> None:
        calls[0] += 1
        step()

    connector.step = counted
    return calls


async def test_an_idle_engine_notices_a_flush_and_republishes(tiny_llama, private_redis) -> None:
    srv = private_redis()
    url = f"{srv.url}?timeout=0.5&flush_check={CHECK_S}"
    eng = AsyncEngine(EngineConfig(model=str(tiny_llama), kv_tier=url, **OPTIONS))
    connector = eng.engine.connector
    try:
        async for _ in eng.generate("first", PROMPT, GREEDY):
            pass
        assert connector.flush(10.0)
        fingerprint = eng.engine.model_fingerprint
        expected = {tier_key(fingerprint, h) for h in block_hashes(PROMPT, BLOCK)}
        assert _block_keys(srv.port, fingerprint) == expected
        # Idle from here on: the loop wakes for the due checks only (one every CHECK_S).
        steps = _count_steps(connector)
        await asyncio.sleep(4 * CHECK_S)
        assert 2 <= steps[0] <= 12, steps[0]  # a handful of wake-ups, not a 50 ms spin (24+)
        redis.Redis(port=srv.port).flushall()
        deadline = time.monotonic() + 20
        while _block_keys(srv.port, fingerprint) != expected:
            assert time.monotonic() < deadline, "the idle replica did not notice the flush"
            await asyncio.sleep(0.05)
        republisher = connector.republisher
        while republisher.active:
            assert time.monotonic() < deadline, "the pass did not end"
            await asyncio.sleep(0.05)
        assert republisher.passes == 1 and republisher.last_outcome == "done"
        assert connector.flush(10.0) and connector.stats().blocks_republished == 5
    finally:
        await asyncio.wait_for(eng.shutdown(), 30)
    assert not eng._thread.is_alive()


async def test_an_idle_engine_without_checks_never_wakes(tiny_llama, private_redis) -> None:
    """``flush_check=0`` (or ``memory://``): nothing is due, so the idle loop waits for a command."""
    srv = private_redis()
    eng = AsyncEngine(EngineConfig(model=str(tiny_llama), kv_tier=srv.url + "?flush_check=0", **OPTIONS))
    connector = eng.engine.connector
    try:
        async for _ in eng.generate("first", PROMPT, GREEDY):
            pass
        assert connector.flush(10.0)
        steps = _count_steps(connector)
        await asyncio.sleep(1.0)
        assert steps[0] == 0
        assert connector.kv.tier.poll_due_in() is None
    finally:
        await asyncio.wait_for(eng.shutdown(), 30)
