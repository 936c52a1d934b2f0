"""KVConnector against a real Redis: exact save/load, bounded non-blocking writes, prefix semantics."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import redis
import torch

from kvcache.connector import KVConnector
from kvcache.keys import block_hashes, tier_key

NUM_LAYERS, BLOCK, KV_HEADS, HEAD_DIM, NUM_BLOCKS = 2, 16, 2, 8, 12
SHAPE = (NUM_LAYERS, 2, BLOCK, KV_HEADS, HEAD_DIM)
HASHES = block_hashes(list(range(BLOCK * 8)), BLOCK)
REPO = Path(__file__).resolve().parents[2]


def _caches(
    dtype: torch.dtype = torch.float32, seed: int | None = 0
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    shape = (NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    if seed is None:  # a fresh engine's cache: a sentinel value that no saved block contains
        return (
            [torch.full(shape, -7.0, dtype=dtype) for _ in range(NUM_LAYERS)],
            [torch.full(shape, -7.0, dtype=dtype) for _ in range(NUM_LAYERS)],
        )
    g = torch.Generator().manual_seed(seed)
    return (
        [torch.randn(shape, generator=g).to(dtype) for _ in range(NUM_LAYERS)],
        [torch.randn(shape, generator=g).to(dtype) for _ in range(NUM_LAYERS)],
    )


def _block(k: list[torch.Tensor], v: list[torch.Tensor], block_id: int) -> torch.Tensor:
    return torch.stack([torch.stack([k[i][block_id], v[i][block_id]]) for i in range(NUM_LAYERS)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_save_then_load_into_other_block_ids_is_identical(redis_url: str, dtype: torch.dtype) -> None:
    k, v = _caches(dtype)
    with KVConnector(redis_url, "fp", SHAPE, dtype) as conn:
        assert conn.save_many(HASHES[:3], [4, 9, 2], k, v) == 3
        assert conn.flush(5.0)
        assert conn.lookup(HASHES) == 3
        k2, v2 = _caches(dtype, seed=None)
        assert conn.load(HASHES[:3], [0, 1, 11], k2, v2) == 3
        for src, dst in ((4, 0), (9, 1), (2, 11)):
            assert torch.equal(_block(k2, v2, dst), _block(k, v, src))
        # Blocks not named were not touched.
        assert all(bool((k2[i][2:11] == -7).all()) for i in range(NUM_LAYERS))
        s = conn.stats()
        assert (s.blocks_saved, s.blocks_loaded, s.writes_dropped, s.pending_writes) == (3, 3, 0, 0)
    size = 64 + NUM_LAYERS * 2 * BLOCK * KV_HEADS * HEAD_DIM * dtype.itemsize
    assert redis.Redis.from_url(redis_url).strlen(tier_key("fp", HASHES[0])) == size


def test_save_snapshots_at_call_time(redis_url: str) -> None:
    k, v = _caches()
    expected = _block(k, v, 3).clone()
    with KVConnector(redis_url, "fp", SHAPE, torch.float32) as conn:
        conn.save(HASHES[0], 3, k, v)
        for t in k + v:  # the engine reuses the slot right away
            t[3].fill_(123.0)
        conn.flush(5.0)
        k2, v2 = _caches(seed=None)
        assert conn.load(HASHES[:1], [5], k2, v2) == 1
        assert torch.equal(_block(k2, v2, 5), expected)


def test_load_stops_at_first_miss(redis_url: str) -> None:
    k, v = _caches()
    with KVConnector(redis_url, "fp", SHAPE, torch.float32) as conn:
        conn.save_many([HASHES[0], HASHES[1], HASHES[3]], [0, 1, 3], k, v)
        conn.flush(5.0)
        assert conn.lookup(HASHES[:4]) == 2
        k2, v2 = _caches(seed=None)
        assert conn.load(HASHES[:4], [6, 7, 8, 9], k2, v2) == 2
        assert torch.equal(_block(k2, v2, 7), _block(k, v, 1))
        assert bool((_block(k2, v2, 9) == -7).all())  # block 3 exists but follows a miss: untouched
        assert conn.load(HASHES[2:4], [8, 9], k2, v2) == 0


def test_load_stops_at_corrupt_value(redis_url: str, metric) -> None:
    k, v = _caches()
    with KVConnector(redis_url, "fp", SHAPE, torch.float32) as conn:
        conn.save_many(HASHES[:3], [0, 1, 2], k, v)
        conn.flush(5.0)
        raw = redis.Redis.from_url(redis_url)
        key = tier_key("fp", HASHES[1])
        value = bytearray(raw.get(key))
        value[1000] ^= 0xFF
        raw.set(key, bytes(value))
        before = metric("ferry:kv_tier_errors_total", kind="corrupt")
        k2, v2 = _caches(seed=None)
        assert conn.load(HASHES[:3], [3, 4, 5], k2, v2) == 1
        assert metric("ferry:kv_tier_errors_total", kind="corrupt") == before + 1
        assert conn.stats().corrupt_blocks == 1
        assert bool((_block(k2, v2, 4) == -7).all())


def test_other_fingerprint_misses(redis_url: str) -> None:
    k, v = _caches()
    with (
        KVConnector(redis_url, "model-a", SHAPE, torch.float32) as a,
        KVConnector(redis_url, "model-b", SHAPE, torch.float32) as b,
    ):
        a.save_many(HASHES[:2], [0, 1], k, v)
        a.flush(5.0)
        assert a.lookup(HASHES[:2]) == 2
        k2, v2 = _caches(seed=None)
        assert b.lookup(HASHES[:2]) == 0 and b.load(HASHES[:2], [0, 1], k2, v2) == 0


def test_full_write_queue_drops_and_counts_instead_of_blocking(redis_url: str, metric) -> None:
    k, v = _caches()
    before = metric("ferry:kv_tier_dropped_writes_total")
    with KVConnector(redis_url, "fp", SHAPE, torch.float32, write_queue=2) as conn:
        assert conn.save_many(HASHES[:5], [0, 1, 2, 3, 4], k, v) == 2  # 2 slots: 3 dropped at once
        assert metric("ferry:kv_tier_dropped_writes_total") == before + 3
        assert conn.stats().writes_dropped == 3
        assert conn.flush(5.0)
        assert conn.lookup(HASHES[:5]) == 2
        assert conn.save(HASHES[2], 2, k, v) is True  # room again after the writer drained


def test_republish_takes_only_the_spare_half_of_the_queue_and_drops_nothing(private_redis, metric) -> None:
    """save_many and republish share one path; only what finds no slot differs: a save drops it
    (counted), a re-publication leaves it to its caller and never takes the queue's last half.
    Redis is held with SIGSTOP so no slot comes back until the end."""
    srv = private_redis()
    k, v = _caches()
    dropped, republished = (
        metric(f"ferry:kv_tier_{m}_total") for m in ("dropped_writes", "republished_blocks")
    )
    url = srv.url + "?timeout=60&connect_timeout=60"
    with KVConnector(url, "fp", SHAPE, torch.float32, write_queue=4) as conn:
        os.kill(srv.proc.pid, signal.SIGSTOP)
        try:
            assert conn.save_many(HASHES[:1], [0], k, v) == 1  # 1 of 4 slots taken
            assert conn.republish(HASHES[1:6], [1, 2, 3, 4, 5], k, v) == 1  # 2 of 4 kept free
            assert conn.republish(HASHES[2:6], [2, 3, 4, 5], k, v) == 0
            assert conn.stats().writes_dropped == 0
            assert conn.save_many(HASHES[2:6], [2, 3, 4, 5], k, v) == 2  # the free half; 2 dropped
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        assert conn.flush(30.0)
        s = conn.stats()
        assert (s.blocks_saved, s.blocks_republished, s.writes_dropped, s.pending_writes) == (4, 1, 2, 0)
    assert metric("ferry:kv_tier_dropped_writes_total") - dropped == 2
    assert metric("ferry:kv_tier_republished_blocks_total") - republished == 1
    stored = {key.decode() for key in redis.Redis.from_url(srv.url).keys("ferry:kv:*")}
    assert stored == {tier_key("fp", h) for h in HASHES[:4]}
    k2, v2 = _caches(seed=None)
    with KVConnector(srv.url, "fp", SHAPE, torch.float32) as reader:
        assert reader.load(HASHES[:4], [6, 7, 8, 9], k2, v2) == 4
    for src, dst in ((0, 6), (1, 7), (2, 8), (3, 9)):
        assert torch.equal(_block(k2, v2, dst), _block(k, v, src))


def test_saves_while_redis_is_down_never_block(redis_server, redis_url: str, metric) -> None:
    k, v = _caches()
    url = redis_url + "?breaker_failures=1&breaker_cooldown=30&timeout=0.5&connect_timeout=0.5"
    with KVConnector(url, "fp", SHAPE, torch.float32, write_queue=4) as conn:
        redis_server.stop()
        try:
            before = metric("ferry:kv_tier_dropped_writes_total")
            start = time.monotonic()
            queued = sum(conn.save(h, i % NUM_BLOCKS, k, v) for i, h in enumerate(HASHES))
            assert time.monotonic() - start < 1.0  # snapshots only; the I/O is the writer's
            assert conn.flush(5.0)
            assert queued >= 4
            # Every block is accounted for: dropped at the queue or lost by a failed write.
            assert metric("ferry:kv_tier_dropped_writes_total") == before + len(HASHES)
            assert conn.stats().blocks_saved == 0
            k2, v2 = _caches(seed=None)
            assert conn.lookup(HASHES) == 0 and conn.load(HASHES[:2], [0, 1], k2, v2) == 0
        finally:
            redis_server.start()


def test_load_async_returns_a_future(redis_url: str) -> None:
    k, v = _caches()
    with KVConnector(redis_url, "fp", SHAPE, torch.float32) as conn:
        conn.save_many(HASHES[:4], [0, 1, 2, 3], k, v)
        conn.flush(5.0)
        k2, v2 = _caches(seed=None)
        seen: list[int] = []
        fut = conn.load_async(HASHES[:5], [7, 8, 9, 10, 11], k2, v2, then=seen.append)
        assert fut.result(timeout=10) == 4
        assert seen == [4]  # ran on the loader thread before the future completed
        assert torch.equal(_block(k2, v2, 10), _block(k, v, 3))


def test_misuse_raises_value_error(redis_url: str) -> None:
    k, v = _caches()
    with KVConnector(redis_url, "fp", SHAPE, torch.float32) as conn:
        with pytest.raises(ValueError, match="2 hashes but 1 block ids"):
            conn.load(HASHES[:2], [0], k, v)
        k16, v16 = _caches(torch.float16)
        with pytest.raises(ValueError, match="does not match"):
            conn.save(HASHES[0], 0, k16, v16)
        with pytest.raises(ValueError, match="expected 2 K and 2 V caches"):
            conn.load_async(HASHES[:1], [0], k[:1], v[:1])
    with pytest.raises(ValueError, match="block_shape"):
        KVConnector("memory://", "fp", (2, 3, 16, 2, 8), torch.float32)
    # One part per layer (an MLA latent): V caches are a mistake there.
    with KVConnector("memory://", "fp", (SHAPE[0], 1, *SHAPE[2:]), torch.float32) as latent:
        with pytest.raises(ValueError, match="expected 2 K and 0 V caches"):
            latent.save(HASHES[0], 0, k, v)
        assert latent.save(HASHES[0], 0, k, []) is True


def test_memory_tier_connector_and_close_flushes() -> None:
    k, v = _caches()
    conn = KVConnector("memory://conn-test", "fp", SHAPE, torch.float32)
    other = KVConnector("memory://conn-test", "fp", SHAPE, torch.float32)
    conn.save_many(HASHES[:3], [0, 1, 2], k, v)
    conn.close()  # writes what was queued before stopping
    assert other.lookup(HASHES) == 3
    k2, v2 = _caches(seed=None)
    assert other.load(HASHES[:3], [5, 6, 7], k2, v2) == 3
    assert torch.equal(_block(k2, v2, 7), _block(k, v, 2))
    assert conn.lookup(HASHES) == 0 and conn.save(HASHES[4], 4, k, v) is False  # closed
    assert conn.load_async(HASHES[:1], [0], k2, v2).result(timeout=5) == 0
    other.close()


CHILD = textwrap.dedent(
    """
    import hashlib, json, sys, torch
    from kvcache.connector import KVConnector
    from kvcache.keys import block_hashes
    url, n = sys.argv[1], int(sys.argv[2])
    hashes = block_hashes(list(range(16 * 8)), 16)[:n]
    k = [torch.zeros(12, 16, 2, 8, dtype=torch.bfloat16) for _ in range(2)]
    v = [torch.zeros(12, 16, 2, 8, dtype=torch.bfloat16) for _ in range(2)]
    with KVConnector(url, "shared", (2, 2, 16, 2, 8), torch.bfloat16) as conn:
        found = conn.lookup(hashes)
        loaded = conn.load(hashes, list(range(n)), k, v)
    digests = [hashlib.sha256(torch.stack([torch.stack([k[l][b], v[l][b]]) for l in range(2)])
               .view(torch.uint8).numpy().tobytes()).hexdigest() for b in range(loaded)]
    print(json.dumps({"found": found, "loaded": loaded, "digests": digests}))
    """
)


def test_second_process_loads_byte_identical_blocks(redis_url: str) -> None:
    k, v = _caches(torch.bfloat16)
    ids = [3, 1, 4, 10, 5]
    with KVConnector(redis_url, "shared", SHAPE, torch.bfloat16) as conn:
        conn.save_many(HASHES[:5], ids, k, v)
        assert conn.flush(5.0)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, redis_url, "6"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    expected = [hashlib.sha256(_block(k, v, b).view(torch.uint8).numpy().tobytes()).hexdigest() for b in ids]
    assert result == {"found": 5, "loaded": 5, "digests": expected}
