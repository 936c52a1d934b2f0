"""Engine + tier end to end: a second engine loads a prefix another engine computed.

Real tiny Llama, real Redis. Greedy outputs must equal a cold run's, and the counters must show
that every loadable block came from the tier (none recomputed).
"""

from __future__ import annotations

import pytest
import redis
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from kvcache.keys import block_hashes, tier_key

BLOCK = 16
PROMPT = [(7 * i + 3) % 900 + 10 for i in range(5 * BLOCK)]  # 80 tokens: 5 full blocks
LOADABLE = (len(PROMPT) - 1) // BLOCK  # the last prompt token is always computed (its logits sample)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
OPTIONS = {"block_size": BLOCK, "num_kv_blocks": 64, "deterministic": True}


@pytest.fixture(scope="module")
def cold_tokens(tiny_llama) -> list[int]:
    return LLM(str(tiny_llama), **OPTIONS).generate([PROMPT], GREEDY)[0].outputs[0].token_ids


def _run(llm: LLM) -> tuple[list[int], int]:
    out = llm.generate([PROMPT], GREEDY)[0]
    return out.outputs[0].token_ids, out.num_cached_tokens


def test_second_engine_loads_prefix_from_redis(tiny_llama, redis_url: str, cold_tokens: list[int]) -> None:
    a = LLM(str(tiny_llama), kv_tier=redis_url, **OPTIONS)
    tokens_a, cached_a = _run(a)
    assert tokens_a == cold_tokens and cached_a == 0
    assert a.engine.connector.flush(10.0)
    saved = a.engine.connector.stats()
    # Every full block A registered was written: 5 prompt blocks + (80 + 11) // 16 - 5 = 0 more.
    assert saved.blocks_saved == (len(PROMPT) + GREEDY.max_tokens - 1) // BLOCK
    fingerprint = a.engine.model_fingerprint
    raw = redis.Redis.from_url(redis_url)
    hashes = block_hashes(PROMPT, BLOCK)
    assert all(raw.exists(tier_key(fingerprint, h)) for h in hashes)

    b = LLM(str(tiny_llama), kv_tier=redis_url, **OPTIONS)
    tokens_b, cached_b = _run(b)
    assert tokens_b == cold_tokens
    s = b.engine.connector.stats()
    assert s.blocks_loaded == LOADABLE == 4 and s.corrupt_blocks == 0
    assert cached_b == LOADABLE * BLOCK  # 64 prompt tokens served by the tier, 16 computed
    assert b.engine.stats().prefix_cache_hits == LOADABLE * BLOCK
    # Loaded blocks are not written back, nor the 5th, which B computes (it holds the prompt's last
    # token) but A wrote already: its lookup asked for it too (kvcache/engine_adapter.py).
    assert b.engine.connector.flush(10.0) and b.engine.connector.stats().blocks_saved == 0
    assert s.blocks_looked_up == LOADABLE + 1


def test_memory_tier_shared_in_process(tiny_llama, cold_tokens: list[int]) -> None:
    a = LLM(str(tiny_llama), kv_tier="memory://engine-share", **OPTIONS)
    b = LLM(str(tiny_llama), kv_tier="memory://engine-share", **OPTIONS)
    assert _run(a) == (cold_tokens, 0)
    assert a.engine.connector.flush(10.0)
    assert _run(b) == (cold_tokens, LOADABLE * BLOCK)


def test_dead_tier_falls_back_to_recompute(tiny_llama, cold_tokens: list[int]) -> None:
    llm = LLM(str(tiny_llama), kv_tier="redis://127.0.0.1:1/0?timeout=0.2&connect_timeout=0.2", **OPTIONS)
    assert _run(llm) == (cold_tokens, 0)
    s = llm.engine.connector.stats()
    assert s.blocks_loaded == 0 and s.tier.errors.get("connection", 0) >= 1


def test_corrupt_block_loads_the_prefix_before_it(tiny_llama, redis_url: str, cold_tokens: list[int]) -> None:
    a = LLM(str(tiny_llama), kv_tier=redis_url, **OPTIONS)
    _run(a)
    assert a.engine.connector.flush(10.0)
    raw = redis.Redis.from_url(redis_url)
    key = tier_key(a.engine.model_fingerprint, block_hashes(PROMPT, BLOCK)[2])
    value = bytearray(raw.get(key))
    value[-1] ^= 0x40
    raw.set(key, bytes(value))
    b = LLM(str(tiny_llama), kv_tier=redis_url, **OPTIONS)
    assert _run(b) == (cold_tokens, 2 * BLOCK)  # blocks 0 and 1 loaded, 2.. recomputed
    assert b.engine.connector.stats().corrupt_blocks == 1


def test_producer_request_waits_for_its_blocks_to_reach_the_tier(tiny_llama, redis_url: str) -> None:
    llm = LLM(str(tiny_llama), kv_tier=redis_url, **OPTIONS)
    engine = llm.engine
    req = engine.make_request(
        "p1", PROMPT, SamplingParams(max_tokens=1, temperature=0.0), kv_transfer={"role": "producer"}
    )
    engine.add_request(req)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    assert final is not None and final.kv_transfer["tier_write_complete"] is True
    assert final.kv_transfer["tier_blocks"] == len(PROMPT) // BLOCK
    hexes = final.kv_transfer["block_hashes"]
    assert hexes == [h.hex() for h in block_hashes(PROMPT, BLOCK)]
    raw = redis.Redis.from_url(redis_url)
    # At hand-off time every prompt block is already readable by a consumer.
    assert all(raw.exists(f"ferry:kv:{engine.model_fingerprint}:{h}") for h in hexes)


def test_async_load_into_engine_cache_is_bit_exact(tiny_llama, redis_url: str) -> None:
    a = LLM(str(tiny_llama), kv_tier=redis_url, **OPTIONS)
    _run(a)
    assert a.engine.connector.flush(10.0)
    hashes = block_hashes(PROMPT, BLOCK)[:4]
    a_ids = [
        a.engine.block_manager.lookup(h, PROMPT[i * BLOCK : (i + 1) * BLOCK]) for i, h in enumerate(hashes)
    ]
    assert None not in a_ids

    b = LLM(str(tiny_llama), kv_tier=redis_url, **OPTIONS)
    bm = b.engine.block_manager
    table: list[int] = []
    assert bm.allocate(table, [], 4 * BLOCK)
    fut = b.engine.connector.load_blocks_async(None, table, hashes)
    assert fut.result(timeout=30) == 4
    for (ka, va), (kb, vb) in zip(
        a.engine.model_runner.kv_caches, b.engine.model_runner.kv_caches, strict=True
    ):
        assert torch.equal(kb[table], ka[a_ids]) and torch.equal(vb[table], va[a_ids])
    # Registering the loaded blocks must not write them back to the tier.
    bm.cache_full_blocks(table, PROMPT, hashes, 0)
    assert b.engine.connector.flush(10.0) and b.engine.connector.stats().blocks_saved == 0
    bm.free(table)
    bm.check_integrity()


def test_producer_with_dead_tier_still_answers(tiny_llama, cold_tokens: list[int]) -> None:
    llm = LLM(str(tiny_llama), kv_tier="redis://127.0.0.1:1/0?timeout=0.2&connect_timeout=0.2", **OPTIONS)
    engine = llm.engine
    req = engine.make_request("p2", PROMPT, GREEDY, kv_transfer={"role": "producer"})
    engine.add_request(req)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    assert [t for o in outs for t in o.outputs[0].token_ids] == cold_tokens
    assert outs[-1].kv_transfer["tier_write_complete"] is False and outs[-1].kv_transfer["tier_blocks"] == 0


def test_mla_latent_blocks_round_trip_through_redis(tiny_deepseek, redis_url: str) -> None:
    """DeepSeek's cache is one latent per token: tier blocks are (layers, 1, block, 1, 24), and a
    second engine serves the prefix from them with the cold run's tokens."""
    from kvcache.codec import HEADER_SIZE

    cold = LLM(str(tiny_deepseek), **OPTIONS).generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    a = LLM(str(tiny_deepseek), kv_tier=redis_url, **OPTIONS)
    assert _run(a) == (cold, 0)
    assert a.engine.connector.flush(10.0)
    assert a.engine.connector.kv.block_shape == (2, 1, BLOCK, 1, 24)
    raw = redis.Redis.from_url(redis_url)
    keys = [tier_key(a.engine.model_fingerprint, h) for h in block_hashes(PROMPT, BLOCK)]
    assert [raw.strlen(k) for k in keys] == [HEADER_SIZE + 2 * BLOCK * 24 * 4] * 5
    b = LLM(str(tiny_deepseek), kv_tier=redis_url, **OPTIONS)
    assert _run(b) == (cold, LOADABLE * BLOCK)
    assert b.engine.connector.stats().blocks_loaded == LOADABLE
    # The blocks landed bit for bit.
    hashes = block_hashes(PROMPT, BLOCK)[:LOADABLE]
    ids_a = [
        a.engine.block_manager.lookup(h, PROMPT[i * BLOCK : (i + 1) * BLOCK]) for i, h in enumerate(hashes)
    ]
    ids_b = [
        b.engine.block_manager.lookup(h, PROMPT[i * BLOCK : (i + 1) * BLOCK]) for i, h in enumerate(hashes)
    ]
    for (la,), (lb,) in zip(a.engine.model_runner.kv_caches, b.engine.model_runner.kv_caches, strict=True):
        assert torch.equal(la[ids_a], lb[ids_b])


def test_dead_tier_shortfall_lines_are_kept_to_a_rate(tiny_llama, caplog) -> None:
    # A tier that is down makes every producer request fall short; one WARNING each flooded the
    # prefill workers' logs in the chaos run (bench/chaos.py). At most 10 lines per 10 s.
    llm = LLM(str(tiny_llama), kv_tier="redis://127.0.0.1:1/0?timeout=0.2&connect_timeout=0.2", **OPTIONS)
    engine = llm.engine
    one = SamplingParams(max_tokens=1, temperature=0.0)
    for i in range(15):
        engine.add_request(engine.make_request(f"p{i}", PROMPT, one, kv_transfer={"role": "producer"}))
    with caplog.at_level("WARNING", logger="kvcache.engine_adapter"):
        finished = []
        while engine.has_unfinished_requests():
            finished += [o for o in engine.step() if o.finished]
    assert len(finished) == 15 and all(o.kv_transfer["tier_blocks"] == 0 for o in finished)
    lines = [r for r in caplog.records if "prompt blocks reached the tier" in r.getMessage()]
    assert len(lines) == 10
