"""A multi-block tier write that fails part-way counts exactly: every block ends as written (the tier
acknowledged it, and it is there) or dropped, in the writer's counters, ``TierStats`` and the
Prometheus series alike. A real Redis that fills up or drops the connection mid-write; the memory
tier's bound."""

from __future__ import annotations

import pytest
import redis
import torch

from kvcache import codec, redis_tier
from kvcache.connector import KVConnector
from kvcache.events import events_stream
from kvcache.keys import block_hashes, tier_key
from kvcache.tier import open_tier
from kvcache.writer import BlockWrite, BlockWriter

# 128 KiB blocks: a few of them cross a Redis maxmemory set just above what the server uses.
NUM_LAYERS, BLOCK, KV_HEADS, HEAD_DIM, NUM_BLOCKS = 2, 16, 8, 64, 24
SHAPE = (NUM_LAYERS, 2, BLOCK, KV_HEADS, HEAD_DIM)
HASHES = block_hashes(list(range(BLOCK * NUM_BLOCKS)), BLOCK)
VALUE_BYTES = codec.encoded_size(torch.float32, SHAPE)


def _caches() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    shape = (NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    return (
        [torch.randn(shape, generator=g) for _ in range(NUM_LAYERS)],
        [torch.randn(shape, generator=g) for _ in range(NUM_LAYERS)],
    )


def _counters(metric) -> tuple[float, float]:
    return metric("ferry:kv_tier_dropped_writes_total"), metric("ferry:kv_tier_bytes_written_total")


def test_redis_filling_up_mid_batch_counts_exactly_the_refused_blocks(private_redis, metric) -> None:
    """Redis under ``noeviction`` reaches ``maxmemory`` inside one batch: the SETs before are
    stored, the rest refused. Written, dropped, bytes and the tier's "stored" events name exactly
    the blocks Redis holds."""
    tier_srv, events_srv = private_redis(), private_redis()
    raw = redis.Redis(port=tier_srv.port)
    raw.config_set("maxmemory-policy", "noeviction")
    raw.config_set("maxmemory", raw.info("memory")["used_memory"] + 8 * VALUE_BYTES)
    k, v = _caches()
    dropped, written_bytes = _counters(metric)
    with KVConnector(
        tier_srv.url,
        "fp",
        SHAPE,
        torch.float32,
        write_queue=NUM_BLOCKS,
        events=True,
        events_url=events_srv.url,
    ) as conn:
        assert conn.save_many(HASHES, list(range(NUM_BLOCKS)), k, v) == NUM_BLOCKS
        assert conn.flush(10.0)
        present = [bool(raw.exists(tier_key("fp", h))) for h in HASHES]
        stored = sum(present)
        assert 0 < stored < NUM_BLOCKS
        assert present == [True] * stored + [False] * (NUM_BLOCKS - stored)  # refused from the first OOM on
        s = conn.stats()
        assert (s.blocks_saved, s.writes_dropped, s.pending_writes) == (stored, NUM_BLOCKS - stored, 0)
        assert (s.tier.blocks_written, s.tier.bytes_written) == (stored, stored * VALUE_BYTES)
        assert s.tier.errors.get("response", 0) >= 1 and s.tier.breaker_state == "closed"
        assert _counters(metric) == (dropped + NUM_BLOCKS - stored, written_bytes + stored * VALUE_BYTES)
        assert conn.lookup(HASHES) == stored
    # A cache-aware router learns of exactly the blocks that are in the tier.
    entries = redis.Redis(port=events_srv.port).xrange(events_stream("fp"))
    announced = [
        h
        for _, f in entries
        if f[b"kind"] == b"stored" and f[b"medium"] == b"tier"
        for h in f[b"hashes"].decode().split(",")
    ]
    assert announced == [h.hex() for h in HASHES[:stored]]


def test_a_connection_closed_mid_write_counts_only_what_redis_acknowledged(
    private_redis, metric, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis drops the connection in the middle of a multi-round-trip write (here: at a value past
    its ``proto-max-bulk-len``): the writes it acknowledged before count as written, the one in
    flight and those after as not, and the failure is counted once."""
    srv = private_redis()
    raw = redis.Redis(port=srv.port)
    raw.config_set("proto-max-bulk-len", 1 << 20)
    monkeypatch.setattr(redis_tier, "WRITE_CHUNK_BYTES", 1)  # one round trip per SET
    keys = [tier_key("fp", h) for h in HASHES[:5]]
    values = [b"a" * 1000, b"b" * 2000, b"c" * (2 << 20), b"d" * 1000, b"e" * 1000]
    dropped, written_bytes = _counters(metric)
    tier = open_tier(srv.url + "?breaker_failures=3")
    try:
        assert tier.put_many(list(zip(keys, values, strict=True))) == [True, True, False, False, False]
        assert sorted(raw.keys("*")) == sorted(k.encode() for k in keys[:2])
        s = tier.stats()
        assert (s.blocks_written, s.bytes_written) == (2, 3000)
        # The server answers "Protocol error" and closes; the client reads that answer or, when it
        # is still sending, a reset connection: either way one failure.
        assert sum(s.errors.values()) == 1 and set(s.errors) <= {"connection", "response"}
        assert _counters(metric) == (dropped, written_bytes + 3000)
        assert s.breaker_state == "closed"  # one failure of three
    finally:
        tier.close()


def test_memory_tier_counts_refused_and_same_batch_evicted_values() -> None:
    """A batch larger than the bound: a value over the bound is refused, and the values a later one
    of the same call evicts were never readable after it: neither counts as written."""
    tier = open_tier("memory://?max_bytes=300")
    items = [("a", b"a" * 100), ("b", b"b" * 100), ("big", b"x" * 301)]
    items += [("c", b"c" * 100), ("d", b"d" * 100), ("e", b"e" * 100)]
    assert tier.put_many(items) == [False, False, False, True, True, True]
    assert tier.inner.store.keys() == ["c", "d", "e"]
    s = tier.stats()
    assert (s.blocks_written, s.bytes_written, s.evictions, s.bytes_used) == (3, 300, 2, 300)
    # A key written twice in one call and then evicted: both of its writes are gone.
    assert tier.put_many([("f", b"f" * 100), ("f", b"f" * 100), ("g", b"g" * 250)]) == [False, False, True]
    assert tier.stats().blocks_written == 4


def test_a_block_that_cannot_be_encoded_drops_alone(metric) -> None:
    """The writer encodes block by block: one bad block in a batch is dropped, the others written."""
    tier = open_tier("memory://")
    good = torch.zeros((1, 2, 4, 1, 2))
    writes = [
        BlockWrite(HASHES[0], good),
        BlockWrite(HASHES[1], torch.zeros((1, 2, 4, 1, 2), dtype=torch.complex64)),  # no dtype code
        BlockWrite(HASHES[2], good),
    ]
    dropped = metric("ferry:kv_tier_dropped_writes_total")
    encode = metric("ferry:kv_tier_dropped_writes_total", reason="encode")
    writer = BlockWriter(tier, "fp", capacity=8)
    try:
        assert writer.reserve(3) == 3
        writer.submit(writes)
        assert writer.flush(5.0)
        assert (writer.written, writer.dropped, writer.pending) == (2, 1, 0)
        assert metric("ferry:kv_tier_dropped_writes_total") == dropped + 1
        assert metric("ferry:kv_tier_dropped_writes_total", reason="encode") == encode + 1
        assert tier.contains_prefix([tier_key("fp", HASHES[0])]) == 1
        assert tier.contains_prefix([tier_key("fp", HASHES[2])]) == 1
    finally:
        writer.close(5.0)
        tier.close()


def test_a_failed_snapshot_gives_its_slots_back_and_counts_them(metric) -> None:
    """A save whose snapshot raises (a block id out of range: a caller's bug) does not keep its queue
    slots forever: they come back, the blocks count as dropped, and flush does not wait on them."""
    k, v = _caches()
    dropped = metric("ferry:kv_tier_dropped_writes_total")
    with KVConnector("memory://", "fp", SHAPE, torch.float32, write_queue=4) as conn:
        with pytest.raises((IndexError, RuntimeError)):
            conn.save_many(HASHES[:2], [0, NUM_BLOCKS + 5], k, v)
        s = conn.stats()
        assert (s.pending_writes, s.writes_dropped, s.blocks_saved) == (0, 2, 0)
        assert metric("ferry:kv_tier_dropped_writes_total") == dropped + 2
        assert conn.flush(1.0)
        assert conn.save_many(HASHES[:4], [0, 1, 2, 3], k, v) == 4  # every slot is free again
