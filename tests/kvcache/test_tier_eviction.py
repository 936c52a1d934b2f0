"""Blocks Redis evicts (``maxmemory``) are noticed by the replicas that read them.

Real tiny Llama, real redis-server made to evict: ``maxmemory-policy volatile-lru`` and a
``maxmemory`` below what it holds evicts every key with a ttl (the blocks: ``?ttl=``), never the
event stream. Nothing in Redis says a key went (keyspace notifications are off, as on most managed
Redis), so before:

* the tier events (``kvcache/events.py``) kept every evicted block ``stored``: a reader's
  ``PrefixIndex.tier_prefix`` counted blocks no replica could load;
* a producer on a composite tier (``?l1_bytes=``) confirmed its hand-off with its own memory
  level, which still held the blocks: ``tier_write_complete`` true, ``tier_blocks`` all, with
  Redis holding none of them.

Now a read that finds a block gone which the replica had seen held emits a ``removed`` tier event,
the producer confirms with Redis itself, and the requests complete with the same tokens, the tier's
hit and miss counts those of what was really there.
"""

from __future__ import annotations

import time

import redis

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from kvcache.events import KVEventReader, PrefixIndex
from kvcache.keys import block_hashes

BLOCK = 16
PROMPT = [(13 * i + 7) % 900 + 10 for i in range(5 * BLOCK)]  # 80 tokens: 5 full blocks
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)  # 91 tokens with KV: still 5 full blocks
OPTIONS = {"block_size": BLOCK, "num_kv_blocks": 64, "deterministic": True}
HEX = [h.hex() for h in block_hashes(PROMPT, BLOCK)]


def _block_keys(admin: redis.Redis, fingerprint: str) -> list[bytes]:
    return admin.keys(f"ferry:kv:{fingerprint}:*")


def _evict_blocks(admin: redis.Redis, fingerprint: str) -> int:
    """Redis' own eviction takes every block (every key with a ttl); returns how many keys it evicted."""
    before = admin.info("stats")["evicted_keys"]
    admin.config_set("maxmemory-policy", "volatile-lru")
    admin.config_set("maxmemory", "1")
    try:
        deadline = time.monotonic() + 10
        while _block_keys(admin, fingerprint):
            assert time.monotonic() < deadline, "Redis evicted nothing"
            time.sleep(0.01)
    finally:
        admin.config_set("maxmemory", "0")
    return admin.info("stats")["evicted_keys"] - before


def _tier_events(url: str, fingerprint: str) -> list[tuple[str, str, tuple[str, ...]]]:
    """The tier events in order, consecutive ones of a replica and kind joined (the writer's
    batches depend on timing)."""
    reader = KVEventReader(url, fingerprint)
    try:
        events = [e for e in reader.read() if e.medium == "tier"]
    finally:
        reader.close()
    joined: list[tuple[str, str, tuple[str, ...]]] = []
    for e in events:
        if joined and joined[-1][:2] == (e.replica_id, e.kind):
            joined[-1] = (e.replica_id, e.kind, joined[-1][2] + e.block_hashes)
        else:
            joined.append((e.replica_id, e.kind, e.block_hashes))
    return joined


def _generate(llm: LLM) -> tuple[list[int], int]:
    out = llm.generate([PROMPT], GREEDY)[0]
    return out.outputs[0].token_ids, out.num_cached_tokens


def test_an_evicted_prefix_is_reported_removed_and_recomputed(tiny_llama, private_redis) -> None:
    srv = private_redis()
    admin = redis.Redis(port=srv.port)
    url = srv.url + "?ttl=3600&flush_check=0"
    a = LLM(str(tiny_llama), kv_tier=url, kv_events=True, kv_events_replica_id="a", **OPTIONS)
    b = LLM(str(tiny_llama), kv_tier=url, kv_events=True, kv_events_replica_id="b", **OPTIONS)
    try:
        fingerprint = a.engine.model_fingerprint
        tokens, cached = _generate(a)
        assert cached == 0 and a.engine.connector.flush(10.0)
        assert _generate(b) == (tokens, 4 * BLOCK)  # B loads blocks 0..3: it saw them held
        assert b.engine.connector.flush(10.0)
        assert b.engine.connector.stats().tier.hits == 4
        assert _tier_events(srv.url, fingerprint) == [("a", "stored", tuple(HEX))]

        assert _evict_blocks(admin, fingerprint) == 5
        # B's device cache goes too (its LRU, a restart): the prompt comes back to the tier.
        b.engine.block_manager.reset_prefix_cache()
        before = b.engine.connector.stats().tier
        assert _generate(b) == (tokens, 0)  # recomputed, the same tokens
        assert b.engine.connector.flush(10.0)
        after = b.engine.connector.stats().tier
        assert (after.hits - before.hits, after.misses - before.misses) == (0, 4)
        assert b.engine.connector.stats().blocks_loaded == 4  # the first run's, none since

        # B's lookup found block 0 gone, which it had read: removed. Block hashes chain, so a
        # reader's prefix match stops there; then B's writes put the prefix back.
        events = _tier_events(srv.url, fingerprint)
        assert events == [
            ("a", "stored", tuple(HEX)),
            ("b", "removed", (HEX[0],)),
            ("b", "stored", tuple(HEX)),
        ]
        index = PrefixIndex()
        reader = KVEventReader(srv.url, fingerprint)
        try:
            read = [e for e in reader.read() if e.medium == "tier"]
        finally:
            reader.close()
        removal = next(i for i, e in enumerate(read) if e.kind == "removed")
        index.apply_all(read[: removal + 1])
        assert index.tier_prefix(HEX) == 0  # as Redis held it then
        index.apply_all(read[removal + 1 :])
        assert index.tier_prefix(HEX) == 5 == len(_block_keys(admin, fingerprint))
    finally:
        a.close()
        b.close()


def test_a_producer_confirms_its_hand_off_with_redis_not_its_memory_level(tiny_llama, private_redis) -> None:
    srv = private_redis()
    admin = redis.Redis(port=srv.port)
    llm = LLM(str(tiny_llama), kv_tier=srv.url + "?ttl=3600&flush_check=0&l1_bytes=16000000", **OPTIONS)
    try:
        engine = llm.engine
        tokens, _ = _generate(llm)
        assert engine.connector.flush(10.0)
        assert _evict_blocks(admin, engine.model_fingerprint) == 5
        one = SamplingParams(max_tokens=1, temperature=0.0)
        engine.add_request(engine.make_request("p", PROMPT, one, kv_transfer={"role": "producer"}))
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final = out
        assert final is not None and final.outputs[0].token_ids == tokens[:1]
        # Its device cache served the prompt (nothing written); Redis holds none of its blocks.
        assert _block_keys(admin, engine.model_fingerprint) == []
        assert final.kv_transfer["tier_blocks"] == 0
        assert final.kv_transfer["tier_write_complete"] is False
    finally:
        llm.close()


def _connector_events(url: str, fingerprint: str) -> list[tuple[str, tuple[str, ...]]]:
    reader = KVEventReader(url, fingerprint)
    try:
        return [(e.kind, e.block_hashes) for e in reader.read() if e.medium == "tier"]
    finally:
        reader.close()


def test_only_an_answered_read_of_a_block_seen_held_reports_it_removed(private_redis) -> None:
    """The guards, on a connector (no model): a block never seen held, a lookup the tier did not
    answer (Redis down: a miss, not an absence) and a block whose write is still pending (its write
    announces it again: a removal after it would undo that) report nothing."""
    import threading

    import torch

    from kvcache.connector import KVConnector
    from kvcache.keys import tier_key

    srv = private_redis()
    shape = (2, 2, BLOCK, 2, 8)
    caches = [torch.randn(8, BLOCK, 2, 8) for _ in range(2)]
    hashes = block_hashes(list(range(4 * BLOCK)), BLOCK)
    hexes = [h.hex() for h in hashes]
    admin = redis.Redis(port=srv.port)
    url = srv.url + "?flush_check=0&timeout=0.5&connect_timeout=0.5&breaker_failures=1&breaker_cooldown=0.2"
    conn = KVConnector(url, "fp", shape, torch.float32, events=True)
    try:
        assert conn.lookup(hashes) == 0  # nothing seen held yet: no event
        assert conn.save_many(hashes[:2], [0, 1], caches, caches) == 2 and conn.flush(10.0)
        admin.delete(tier_key("fp", hashes[0]))
        assert conn.lookup(hashes) == 0  # block 0 was written here: removed
        assert conn.lookup(hashes) == 0  # reported once
        assert conn.flush(10.0)
        assert _connector_events(srv.url, "fp") == [("stored", tuple(hexes[:2])), ("removed", (hexes[0],))]

        put_many = conn.tier.put_many
        flowing = threading.Event()
        conn.tier.put_many = lambda items: flowing.wait(30) and put_many(items)
        assert conn.save_many(hashes[:1], [0], caches, caches) == 1  # its write waits
        admin.delete(tier_key("fp", hashes[1]))
        assert conn.lookup(hashes[1:]) == 0  # block 1 seen held, gone, no write pending: removed
        conn.tier.put_many = put_many
        flowing.set()
        assert conn.flush(10.0)
        admin.delete(tier_key("fp", hashes[0]))
        conn.tier.put_many = lambda items: flowing.wait(30) and put_many(items)
        flowing.clear()
        assert conn.save_many(hashes[:1], [0], caches, caches) == 1  # pending again
        assert conn.lookup(hashes) == 0  # block 0 gone but being written: nothing
        flowing.set()
        assert conn.flush(10.0)
        conn.tier.put_many = put_many
        assert _connector_events(srv.url, "fp") == [
            ("stored", tuple(hexes[:2])),
            ("removed", (hexes[0],)),
            ("stored", (hexes[0],)),
            ("removed", (hexes[1],)),
            ("stored", (hexes[0],)),
        ]
        srv.stop()
        assert conn.lookup(hashes) == 0  # no answer: nothing, and block 0 still counts as held
        assert conn.presence is not None and tier_key("fp", hashes[0]) in conn.presence
        assert conn.presence.removals == 2
    finally:
        conn.close()
