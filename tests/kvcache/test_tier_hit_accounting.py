"""``ferry:kv_tier_hits_total`` counts blocks that landed, never one found corrupt or read past a miss.

Real Redis, real connector and engine: a block flipped in Redis, or one that went (evicted, expired)
between the lookup and the load, is a miss in the metric (DESIGN.md: "a block that fails its
checksum or header is a miss, counted in a metric"), so a dashboard's hit rate
(hits / (hits + misses)) says how much of what was asked of the tier the engine could use.
"""

from __future__ import annotations

import redis
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from kvcache.connector import KVConnector
from kvcache.keys import block_hashes, tier_key

NUM_LAYERS, BLOCK, KV_HEADS, HEAD_DIM, NUM_BLOCKS = 2, 16, 2, 8, 12
SHAPE = (NUM_LAYERS, 2, BLOCK, KV_HEADS, HEAD_DIM)
HASHES = block_hashes(list(range(BLOCK * 6)), BLOCK)


def _caches(fill: float | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    shape = (NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    g = torch.Generator().manual_seed(0)
    make = (
        (lambda: torch.full(shape, fill)) if fill is not None else (lambda: torch.randn(shape, generator=g))
    )
    return [make() for _ in range(NUM_LAYERS)], [make() for _ in range(NUM_LAYERS)]


def _counts(metric) -> tuple[float, float]:
    return metric("ferry:kv_tier_hits_total"), metric("ferry:kv_tier_misses_total")


def _flip_last_byte(raw: redis.Redis, key: str) -> None:
    value = bytearray(raw.get(key))
    value[-1] ^= 0x40
    raw.set(key, bytes(value))


def test_corrupt_block_and_the_blocks_after_it_are_misses(redis_url: str, metric) -> None:
    k, v = _caches()
    with KVConnector(redis_url, "fp", SHAPE, torch.float32) as conn:
        assert conn.save_many(HASHES[:4], [0, 1, 2, 3], k, v) == 4
        assert conn.flush(5.0)
        _flip_last_byte(redis.Redis.from_url(redis_url), tier_key("fp", HASHES[1]))
        hits, misses = _counts(metric)
        k2, v2 = _caches(fill=-7.0)
        assert conn.load(HASHES[:4], [4, 5, 6, 7], k2, v2) == 1
        # Block 0 landed; block 1 failed its checksum; blocks 2 and 3 were read but not used.
        assert _counts(metric) == (hits + 1, misses + 3)
        s = conn.stats()
        assert (s.blocks_loaded, s.corrupt_blocks, s.tier.hits, s.tier.misses) == (1, 1, 1, 3)


def test_block_gone_between_lookup_and_load_is_a_miss(redis_url: str, metric) -> None:
    k, v = _caches()
    with KVConnector(redis_url, "fp", SHAPE, torch.float32) as conn:
        assert conn.save_many(HASHES[:4], [0, 1, 2, 3], k, v) == 4
        assert conn.flush(5.0)
        assert conn.lookup(HASHES[:4]) == 4
        redis.Redis.from_url(redis_url).delete(tier_key("fp", HASHES[1]))  # evicted meanwhile
        hits, misses = _counts(metric)
        k2, v2 = _caches(fill=-7.0)
        assert conn.load(HASHES[:4], [4, 5, 6, 7], k2, v2) == 1
        assert _counts(metric) == (hits + 1, misses + 3)


def test_engine_counts_only_the_blocks_it_loaded(tiny_llama, redis_url: str, metric) -> None:
    prompt = [(7 * i + 3) % 900 + 10 for i in range(5 * BLOCK)]  # 5 blocks; 4 loadable
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    options = {"block_size": BLOCK, "num_kv_blocks": 64, "deterministic": True}
    cold = LLM(str(tiny_llama), **options).generate([prompt], greedy)[0].outputs[0].token_ids
    writer = LLM(str(tiny_llama), kv_tier=redis_url, **options)
    writer.generate([prompt], greedy)
    assert writer.engine.connector.flush(10.0)
    key = tier_key(writer.engine.model_fingerprint, block_hashes(prompt, BLOCK)[2])
    _flip_last_byte(redis.Redis.from_url(redis_url), key)

    hits, misses = _counts(metric)
    reader = LLM(str(tiny_llama), kv_tier=redis_url, **options)
    out = reader.generate([prompt], greedy)[0]
    assert out.outputs[0].token_ids == cold and out.num_cached_tokens == 2 * BLOCK
    s = reader.engine.connector.stats()
    assert (s.blocks_loaded, s.corrupt_blocks) == (2, 1)
    # The lookup found 4 blocks; 2 landed, the corrupt 3rd and the 4th behind it did not.
    assert _counts(metric) == (hits + 2, misses + 2)


def test_blocks_the_lookup_did_not_find_are_misses(tiny_llama, redis_url: str, metric) -> None:
    """A dashboard's hit rate covers every block an admission asked the tier for: those the
    lookup found and loaded are hits, those it did not find are misses."""
    prompt = [(11 * i + 5) % 900 + 10 for i in range(5 * BLOCK)]
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    options = {"block_size": BLOCK, "num_kv_blocks": 64, "deterministic": True}
    writer = LLM(str(tiny_llama), kv_tier=redis_url, **options)
    writer.generate([prompt], greedy)  # the tier holds the prompt's 5 blocks
    assert writer.engine.connector.flush(10.0)
    longer = prompt + [(13 * i + 7) % 900 + 10 for i in range(2 * BLOCK)]  # 7 blocks: 6 asked for

    hits, misses = _counts(metric)
    reader = LLM(str(tiny_llama), kv_tier=redis_url, **options)
    out = reader.generate([longer], greedy)[0]
    assert out.num_cached_tokens == 5 * BLOCK
    assert _counts(metric) == (hits + 5, misses + 1)
