"""A stored block names the model it was computed under: a reader refuses (a counted miss, one
warning) a value under one of its keys whose header names another model, layout or format, and
never loads its bytes or fails on them. Real Redis, real connectors."""

from __future__ import annotations

import logging
import struct
import zlib

import pytest
import redis
import torch

from kvcache import codec
from kvcache.connector import KVConnector
from kvcache.keys import block_hashes, tier_key

NUM_LAYERS, BLOCK, KV_HEADS, HEAD_DIM, NUM_BLOCKS = 2, 16, 2, 8, 6
SHAPE = (NUM_LAYERS, 2, BLOCK, KV_HEADS, HEAD_DIM)
HASHES = block_hashes(list(range(BLOCK * 4)), BLOCK)
SENTINEL = -7.0


def _caches(
    shape: tuple[int, ...] = SHAPE, dtype: torch.dtype = torch.float32, fill: float | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer K and V caches; an MLA layout (one part) has only its latent, passed as K."""
    layers, parts, block, heads, dim = shape
    per_layer = (NUM_BLOCKS, block, heads, dim)
    g = torch.Generator().manual_seed(0)

    def make() -> list[torch.Tensor]:
        if fill is not None:
            return [torch.full(per_layer, fill, dtype=dtype) for _ in range(layers)]
        return [torch.randn(per_layer, generator=g).to(dtype) for _ in range(layers)]

    k = make()
    return k, make() if parts == 2 else []


def _untouched(k: list[torch.Tensor], v: list[torch.Tensor]) -> bool:
    return all(bool((t == SENTINEL).all()) for t in k + v)


def _errors(metric) -> tuple[float, float]:
    return metric("ferry:kv_tier_errors_total", kind="mismatch"), metric(
        "ferry:kv_tier_errors_total", kind="corrupt"
    )


@pytest.fixture(autouse=True)
def _fresh_mismatch_log(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec, "_mismatches_warned", set())


def test_another_models_block_under_our_key_is_refused(redis_url: str, metric, caplog) -> None:
    """Two models of one layout share a Redis: a value of model A's found under model B's key (copied,
    renamed, a fingerprint collision) is refused by B — same dtype and shape, so only the header's
    fingerprint tells them apart — and B recomputes instead of attending over A's KV."""
    k, v = _caches()
    raw = redis.Redis.from_url(redis_url)
    with (
        KVConnector(redis_url, "model-a", SHAPE, torch.float32) as a,
        KVConnector(redis_url, "model-b", SHAPE, torch.float32) as b,
    ):
        assert a.save_many(HASHES[:2], [0, 1], k, v) == 2 and a.flush(5.0)
        for h in HASHES[:2]:
            raw.set(tier_key("model-b", h), raw.get(tier_key("model-a", h)))
        assert b.lookup(HASHES[:2]) == 2  # the keys are there: only the header can tell
        mismatch, corrupt = _errors(metric)
        misses = metric("ferry:kv_tier_misses_total")
        k2, v2 = _caches(fill=SENTINEL)
        with caplog.at_level(logging.DEBUG, logger="kvcache.codec"):
            assert b.load(HASHES[:2], [0, 1], k2, v2) == 0
            assert b.load(HASHES[:2], [2, 3], k2, v2) == 0
        assert _untouched(k2, v2)
        assert _errors(metric) == (mismatch + 2, corrupt)  # the first value of each load
        assert metric("ferry:kv_tier_misses_total") == misses + 4
        s = b.stats()
        assert (s.blocks_loaded, s.mismatched_blocks, s.corrupt_blocks) == (0, 2, 0)
        assert (s.tier.hits, s.tier.misses) == (0, 4)
        # Logged once as a warning (a standing misconfiguration), every later one at debug level.
        levels = [r.levelname for r in caplog.records if "fingerprint" in r.getMessage()]
        assert levels == ["WARNING", "DEBUG"]
        assert HASHES[0].hex() in caplog.records[0].getMessage()
        # Model A still loads its own blocks.
        assert a.load(HASHES[:2], [4, 5], k2, v2) == 2
        assert torch.equal(k2[1][4], k[1][0]) and torch.equal(v2[0][5], v[0][1])


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((NUM_LAYERS + 1, 2, BLOCK, KV_HEADS, HEAD_DIM), torch.float32),  # more layers
        ((NUM_LAYERS, 2, BLOCK * 2, KV_HEADS, HEAD_DIM), torch.float32),  # larger block size
        ((NUM_LAYERS, 2, BLOCK, KV_HEADS * 2, HEAD_DIM // 2), torch.float32),  # same bytes, more heads
        ((NUM_LAYERS, 1, BLOCK, 1, 2 * KV_HEADS * HEAD_DIM), torch.float32),  # same bytes, MLA latent
        (SHAPE, torch.bfloat16),  # another dtype (half the bytes)
    ],
)
def test_a_block_of_another_layout_is_refused_not_loaded(
    redis_url: str, metric, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    """A writer whose layout differs but whose fingerprint does not (a fingerprint given by hand, a
    bug in what it covers) wrote under our keys: refused as a mismatch, no bytes loaded, no error."""
    k, v = _caches(shape, dtype)
    with (
        KVConnector(redis_url, "fp", shape, dtype) as writer,
        KVConnector(redis_url, "fp", SHAPE, torch.float32) as reader,
    ):
        assert writer.save_many(HASHES[:1], [0], k, v) == 1 and writer.flush(5.0)
        mismatch, corrupt = _errors(metric)
        k2, v2 = _caches(fill=SENTINEL)
        assert reader.load(HASHES[:1], [0], k2, v2) == 0
        assert _untouched(k2, v2)
        assert _errors(metric) == (mismatch + 1, corrupt)
        assert reader.stats().mismatched_blocks == 1


def _v1_value(block_hash: bytes, tensor: torch.Tensor) -> bytes:
    """A block as format version 1 wrote it (no fingerprint in the header)."""
    payload = tensor.contiguous().view(torch.uint8).numpy().tobytes()
    prefix = struct.pack("<4sHBB6IQ16sI", b"FKVB", 1, 1, 5, *tensor.shape, 0, len(payload), block_hash, 0)
    crc = zlib.crc32(payload, zlib.crc32(prefix))
    return prefix + struct.pack("<I", crc) + payload


def test_a_block_of_the_previous_format_is_a_miss_then_rewritten(redis_url: str, metric) -> None:
    k, v = _caches()
    block = torch.stack([torch.stack([k[i][3], v[i][3]]) for i in range(NUM_LAYERS)])
    raw = redis.Redis.from_url(redis_url)
    raw.set(tier_key("fp", HASHES[0]), _v1_value(HASHES[0], block))
    with KVConnector(redis_url, "fp", SHAPE, torch.float32) as conn:
        mismatch, corrupt = _errors(metric)
        k2, v2 = _caches(fill=SENTINEL)
        assert conn.load(HASHES[:1], [0], k2, v2) == 0
        assert _untouched(k2, v2)
        assert _errors(metric) == (mismatch + 1, corrupt)
        # The replica recomputes the block and writes it back in the current format.
        assert conn.save(HASHES[0], 3, k, v) and conn.flush(5.0)
        assert raw.getrange(tier_key("fp", HASHES[0]), 4, 5) == struct.pack("<H", codec.FORMAT_VERSION)
        assert conn.load(HASHES[:1], [1], k2, v2) == 1
        assert torch.equal(k2[0][1], k[0][3]) and torch.equal(v2[1][1], v[1][3])


def test_an_intact_header_that_contradicts_itself_is_corrupt(metric) -> None:
    """A header whose crc holds but whose shape and dtype do not make its payload length (a writer's
    bug) is refused as corrupt before any field of it is compared with ours."""
    payload = bytes(1000)  # not 2 * 2 * 16 * 2 * 8 * 4
    prefix = struct.pack(
        "<4sHBB5IQ8s16s", b"FKVB", 2, 1, 5, *SHAPE, len(payload), codec.fingerprint_tag("fp"), HASHES[0]
    )
    value = prefix + struct.pack("<I", zlib.crc32(payload, zlib.crc32(prefix))) + payload
    mismatch, corrupt = _errors(metric)
    args = (HASHES[0], value, torch.float32, SHAPE)
    assert codec.decode_with_reason(*args, fingerprint="fp") == (None, "header")
    assert codec.decode(*args, fingerprint="fp") is None
    assert _errors(metric) == (mismatch, corrupt + 1)
