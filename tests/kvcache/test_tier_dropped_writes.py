"""Writes dropped for a full write queue are re-published once the queue has room again.

Real tiny Llama, real redis-server. ``CLIENT PAUSE … WRITE`` holds the writer's first ``SET`` in
Redis, so with a one-slot queue the other blocks of the prefill find it full, deterministically.
Without re-publication those blocks hit in the replica's own prefix cache from then on and are never
written: every other replica recomputes them.
"""

from __future__ import annotations

import time

import pytest
import redis
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from kvcache import writer as writer_module
from kvcache.keys import block_hashes, tier_key
from kvcache.tier import open_tier
from kvcache.writer import BlockWrite, BlockWriter

BLOCK = 16
PROMPT = [(5 * i + 11) % 900 + 10 for i in range(5 * BLOCK)]  # 80 tokens: 5 full blocks
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)  # 91 tokens with KV: still 5 full blocks
OPTIONS = {"block_size": BLOCK, "num_kv_blocks": 64, "deterministic": True}


def _keys_in(port: int) -> set[str]:
    return {k.decode() for k in redis.Redis(port=port).keys("ferry:kv:*")}


def _wait(done, timeout: float = 10.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_writes_dropped_for_a_full_queue_are_republished(tiny_llama, private_redis, metric) -> None:
    srv = private_redis()
    # A long socket timeout: the paused SET must wait, not fail (a failure would open the breaker
    # and the recovery's pass would write the blocks for another reason).
    a = LLM(str(tiny_llama), kv_tier=srv.url + "?timeout=20", kv_tier_write_queue=1, **OPTIONS)
    engine = a.engine
    connector = engine.connector
    republisher = connector.republisher
    before = metric("ferry:kv_tier_dropped_writes_total", reason="queue_full")
    engine.add_request(engine.make_request("full-queue", PROMPT, GREEDY))
    # Its arrival lookup (a script) answered: blocks 0..3, and block 4, which holds the last token.
    _wait(lambda: connector.stats().blocks_looked_up == 5)
    admin = redis.Redis(port=srv.port)
    admin.execute_command("CLIENT", "PAUSE", 30000, "WRITE")
    try:
        while engine.has_unfinished_requests():
            engine.step()
        # Block 0 took the one slot and waits in Redis; blocks 1..4 found the queue full.
        stats = connector.stats()
        assert (stats.blocks_saved, stats.writes_dropped, stats.pending_writes) == (0, 4, 1)
        # The queue has no room yet: no pass starts (its writes would find no slot either).
        assert republisher.passes == 0
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
    deadline = time.monotonic() + 20
    while not (republisher.passes == 1 and not republisher.active):
        assert time.monotonic() < deadline, "no re-publication pass ran"
        engine.step()  # idle: each waits at most TIER_IDLE_WAIT_S
    assert republisher.last_outcome == "done"
    assert connector.flush(10.0)
    hashes = block_hashes(PROMPT, BLOCK)
    assert len(hashes) == 5
    assert _keys_in(srv.port) == {tier_key(engine.model_fingerprint, h) for h in hashes}
    stats = connector.stats()
    assert (stats.blocks_saved, stats.writes_dropped, stats.blocks_republished) == (5, 4, 4)
    assert metric("ferry:kv_tier_dropped_writes_total", reason="queue_full") - before == 4
    # Nothing is left to do: an idle engine goes back to sleeping.
    assert not republisher.has_work() and not engine.has_idle_work
    a.close()


def test_the_writer_remembers_a_bounded_number_of_dropped_hashes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writer_module, "MAX_DROPPED_REMEMBERED", 3)
    tier = open_tier("memory://?max_bytes=1048576")
    writer = BlockWriter(tier, "fp", capacity=1)
    assert not writer.has_dropped and writer.take_dropped() == ([], False)
    hashes = [bytes([i]) * 16 for i in range(5)]
    writer.drop(hashes[:2])
    assert writer.has_dropped
    assert writer.take_dropped() == (hashes[:2], False)
    assert not writer.has_dropped
    writer.drop(hashes)  # more than it keeps: the oldest three, and the fact that more went
    assert writer.take_dropped() == (hashes[:3], True)
    assert writer.dropped == 7 and writer.take_dropped() == ([], False)
    assert writer.reserve(1) == 1 and writer.free_slots() == 0
    writer.submit([BlockWrite(hashes[0], torch.zeros(4))])
    assert writer.flush(5.0) and writer.free_slots() == 1
    writer.close(5.0)
    writer.drop(hashes[:1])  # closed: counted, but nothing will re-publish it
    assert writer.dropped == 8 and not writer.has_dropped and writer.free_slots() == 0
    tier.close()
