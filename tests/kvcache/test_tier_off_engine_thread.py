"""Admission lookups of a remote tier run off the engine thread, batched, started on arrival.

A real redis-server behind a real TCP proxy on loopback whose replies can be held back
(``bench.local_redis.LatencyProxy``: a Redis that is stalled, as seen from the replica), a real
tiny Llama.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis

from bench.local_redis import LatencyProxy
from engine import LLM, SamplingParams
from engine.sequence import RequestStatus
from kvcache.keys import tier_key
from kvcache.tier import open_tier

BS = 16
PROMPT_A = [(7 * i + 3) % 900 + 10 for i in range(80)]  # 4 full blocks a hit may cover
PROMPT_B = [(5 * i + 1) % 900 + 10 for i in range(10)]  # under one block: asks the tier nothing
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture
def held(redis_server):  # noqa: ANN001, ANN201
    redis_server.flush()
    proxy = LatencyProxy(redis_server.port)
    yield proxy
    proxy.close()


def test_many_lookups_answer_in_one_batch(redis_url: str, held: LatencyProxy) -> None:
    from kvcache.connector import KVConnector

    torch = pytest.importorskip("torch")
    conn = KVConnector(
        f"redis://127.0.0.1:{held.port}/0?timeout=20", "fp", (2, 2, BS, 2, 8), torch.float32, write_queue=8
    )
    try:
        hashes = [bytes([i]) * 32 for i in range(6)]
        raw = redis.Redis.from_url(redis_url)
        raw.mset({tier_key("fp", h): b"x" for h in hashes[:4]})
        raw.set(tier_key("fp", hashes[5]), b"x")
        held.flowing.clear()
        asks = [hashes, hashes[2:], hashes[4:], hashes[5:], [hashes[4]], []]
        futures = [conn.lookup_async(a) for a in asks]
        assert futures[-1].done() and futures[-1].result() == 0  # nothing to ask
        assert not any(f.done() for f in futures[:-1])  # every reply is held back
        held.flowing.set()
        assert [f.result(timeout=20) for f in futures] == [4, 2, 0, 1, 0, 0]
        assert conn.stats().blocks_looked_up == 6 + 4 + 2 + 1 + 1
    finally:
        conn.close()
    closed = conn.lookup_async(hashes)
    assert closed.done() and closed.result() == 0


def test_batched_lookup_survives_a_flushed_script_cache(redis_url: str) -> None:
    tier = open_tier(redis_url)
    try:
        keys = [f"k{i}" for i in range(5)]
        raw = redis.Redis.from_url(redis_url)
        raw.mset({k: b"v" for k in keys[:3]})
        assert tier.contains_prefix_many([keys, keys[1:], keys[3:]]) == [3, 2, 0]
        raw.script_flush()  # what a restarted Redis has forgotten
        assert tier.contains_prefix_many([keys, keys[2:], keys[:1]]) == [3, 1, 1]
        assert tier.stats().errors == {}
    finally:
        tier.close()


def test_batched_lookup_matches_single_lookups_with_an_l1(redis_url: str) -> None:
    tier = open_tier(redis_url + "?l1_bytes=1048576")
    try:
        keys = [f"c{i}" for i in range(8)]
        raw = redis.Redis.from_url(redis_url)
        tier.put_many([(k, b"v") for k in keys[:6]])  # both levels hold c0..c5
        raw.delete(keys[2])  # L2 lost c2, L1 still has it: runs alternate between the levels
        asks = [keys, keys[1:], keys[2:], keys[3:], keys[6:]]
        assert tier.contains_prefix_many(asks) == [tier.contains_prefix(a) for a in asks] == [6, 5, 4, 3, 0]
    finally:
        tier.close()


def test_a_stalled_tier_lookup_holds_only_its_own_request(
    tiny_llama: Path, redis_server, held: LatencyProxy
) -> None:
    with LLM(str(tiny_llama), kv_tier=redis_server.url, block_size=BS, num_kv_blocks=64) as writer:
        ref = writer.generate([PROMPT_A], GREEDY)[0].outputs[0].token_ids
        assert writer.engine.connector.flush(10.0)
    tier = f"redis://127.0.0.1:{held.port}/0?timeout=10"
    with LLM(str(tiny_llama), kv_tier=tier, block_size=BS, num_kv_blocks=64) as llm:
        engine = llm.engine
        a = engine.make_request("a", PROMPT_A, GREEDY)
        b = engine.make_request("b", PROMPT_B, GREEDY)
        held.flowing.clear()  # Redis stalls: the lookup A's arrival started gets no answer
        engine.add_request(a)
        engine.add_request(b)
        finished: dict[str, object] = {}
        for _ in range(40):
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
            if "b" in finished:
                break
        # B ran to its end while A kept its place, waiting for the tier's answer.
        assert "b" in finished and len(b.output_token_ids) == 8
        assert a.status is RequestStatus.WAITING and a.num_computed_tokens == 0
        assert engine.stats().num_waiting == 1
        held.flowing.set()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
        # Once answered, A loaded its 4 blocks from the tier and answers as without it.
        final = engine.post.final(a)
        assert final.num_cached_tokens == 4 * BS
        assert final.outputs[0].token_ids == ref
        assert engine.block_manager.num_used_blocks == 0
        engine.block_manager.check_integrity()


def test_a_producer_waits_for_its_writes_off_the_engine_thread(
    tiny_llama: Path, redis_server, held: LatencyProxy
) -> None:
    tier = f"redis://127.0.0.1:{held.port}/0?timeout=10"
    with LLM(str(tiny_llama), kv_tier=tier, block_size=BS, num_kv_blocks=64) as llm:
        engine = llm.engine
        one = SamplingParams(temperature=0.0, max_tokens=1)
        producer = engine.make_request("p", PROMPT_A, one, kv_transfer={"role": "producer"})
        other = engine.make_request("b", PROMPT_B, GREEDY)
        engine.add_request(producer)
        deadline = time.monotonic() + 60
        while engine.connector.stats().blocks_looked_up < 4:  # its arrival's lookup: answered
            assert time.monotonic() < deadline
            time.sleep(0.01)
        held.flowing.clear()  # then Redis stalls: the producer's block writes get no answer
        engine.add_request(other)
        finals: dict[str, object] = {}
        for _ in range(40):
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
            if "b" in finals:
                break
        # The producer finished computing on the first step and freed its blocks; its final
        # output waits for its writes while the other request runs to its end.
        assert "b" in finals and "p" not in finals
        assert producer.status is RequestStatus.FINISHED and engine.has_unfinished_requests()
        assert engine.block_manager.num_used_blocks == 0
        held.flowing.set()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
        report = finals["p"].kv_transfer
        assert report["tier_blocks"] == 5 and report["tier_write_complete"] is True
        assert len(report["block_hashes"]) == 5  # 80 prompt tokens: 5 full blocks
        assert redis.Redis(port=redis_server.port).dbsize() >= 5


async def test_a_new_command_cuts_short_an_idle_wait_on_the_tier(
    tiny_llama: Path, held: LatencyProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio

    import engine.llm_engine as llm_engine
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig

    # An idle step waits on the stalled lookup this long unless a command interrupts it.
    monkeypatch.setattr(llm_engine, "TIER_IDLE_WAIT_S", 120.0)
    tier = f"redis://127.0.0.1:{held.port}/0?timeout=60"
    eng = AsyncEngine(EngineConfig(model=str(tiny_llama), kv_tier=tier, block_size=BS, num_kv_blocks=64))

    async def run(rid: str, prompt: list[int]) -> tuple[list[int], str | None]:
        tokens: list[int] = []
        reason = None
        async for out in eng.generate(rid, prompt, GREEDY):
            tokens += out.outputs[0].token_ids
            reason = out.outputs[0].finish_reason
        return tokens, reason

    try:
        held.flowing.clear()  # A's arrival lookup gets no answer: the loop idles, waiting on it
        stalled = asyncio.ensure_future(run("a", PROMPT_A))
        for _ in range(500):
            if eng.stats().num_waiting == 1:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # well past the lookup's 20 ms grace: the step waits on the tier
        assert not stalled.done()
        # A new request and an abort are taken at once, not after the idle wait.
        tokens, reason = await asyncio.wait_for(run("b", PROMPT_B), 20)
        assert len(tokens) == 8 and reason == "length"
        await asyncio.wait_for(eng.abort("a"), 20)
        assert (await asyncio.wait_for(stalled, 20)) == ([], "abort")
    finally:
        held.flowing.set()
        await asyncio.wait_for(eng.shutdown(), 30)
