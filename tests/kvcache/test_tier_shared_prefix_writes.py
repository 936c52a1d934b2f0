"""A block is written to the tier once, however many requests and replicas share it.

Real tiny Llama, two engines (two replicas) on one real redis-server (or one shared ``memory://``
store). Replica A computes a prompt ``S + tail`` (6 full blocks) and writes them. Replica B then
serves ``S`` alone (4 full blocks, the prompt ending on a block boundary) and ``S + tail``. The
engine recomputes the block holding a prompt's last token even when the tier holds it (its logits
draw the next token), so it never loads it; before, B wrote that block again: 8 SETs for 6
distinct blocks, and 2 more ``stored`` tier events for blocks the tier already held.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import redis

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from kvcache.events import KVEventReader
from kvcache.keys import block_hashes, tier_key

BLOCK = 16
S = [(5 * i + 11) % 900 + 10 for i in range(4 * BLOCK)]  # the shared prefix: 4 full blocks
A = S + [(9 * i + 2) % 900 + 10 for i in range(2 * BLOCK)]  # 6 full blocks
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
OPTIONS = {"block_size": BLOCK, "num_kv_blocks": 64, "deterministic": True}


def _sets(port: int) -> int:
    return redis.Redis(port=port).info("commandstats").get("cmdstat_set", {}).get("calls", 0)


def _tier_events(url: str, fingerprint: str) -> list[tuple[str, str, tuple[str, ...]]]:
    reader = KVEventReader(url, fingerprint)
    try:
        return [(e.replica_id, e.kind, e.block_hashes) for e in reader.read() if e.medium == "tier"]
    finally:
        reader.close()


def test_a_shared_prefix_is_written_once_across_replicas(tiny_llama, private_redis) -> None:
    srv = private_redis()
    url = srv.url + "?flush_check=0"  # no flush marker: every SET is a block's
    a = LLM(str(tiny_llama), kv_tier=url, kv_events=True, kv_events_replica_id="a", **OPTIONS)
    b = LLM(str(tiny_llama), kv_tier=url, kv_events=True, kv_events_replica_id="b", **OPTIONS)
    try:
        fingerprint = a.engine.model_fingerprint
        want_a = a.generate([A], GREEDY)[0].outputs[0].token_ids
        want_s = a.generate([S], GREEDY)[0].outputs[0].token_ids  # a device hit on A: no write
        assert a.engine.connector.flush(10.0)
        assert _sets(srv.port) == 6
        a_stats = a.engine.connector.stats()
        assert (a_stats.blocks_saved, a_stats.writes_dropped) == (6, 0)

        got = b.generate([S], GREEDY)[0]
        assert got.outputs[0].token_ids == want_s
        assert got.num_cached_tokens == 3 * BLOCK  # blocks 0-2 loaded, block 3 computed
        got = b.generate([A], GREEDY)[0]
        assert got.outputs[0].token_ids == want_a
        assert got.num_cached_tokens == 5 * BLOCK  # 4 on B's device, block 4 loaded, block 5 computed
        assert b.engine.connector.flush(10.0)

        assert _sets(srv.port) == 6  # B wrote nothing: the tier held all it computed
        b_stats = b.engine.connector.stats()
        assert (b_stats.blocks_saved, b_stats.writes_dropped, b_stats.tier.bytes_written) == (0, 0, 0)
        assert b_stats.blocks_loaded == 4
        assert b_stats.tier.hits == 4
        hashes = block_hashes(A, BLOCK)
        admin = redis.Redis(port=srv.port)
        keys = {k.decode() for k in admin.keys(f"ferry:kv:{fingerprint}:*")}
        assert keys == {tier_key(fingerprint, h) for h in hashes}
        assert a_stats.tier.bytes_written == sum(admin.strlen(k) for k in keys)
        # Each block announced once, by the replica that wrote it.
        events = _tier_events(srv.url, fingerprint)
        assert sorted(h for _, kind, hs in events for h in hs if kind == "stored") == sorted(
            h.hex() for h in hashes
        )
        assert {replica for replica, _, _ in events} == {"a"}
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("tier", ["memory://shared-prefix-writes"])
def test_a_shared_prefix_is_written_once_in_process(tiny_llama, tier: str) -> None:
    """The in-process tier answers lookups synchronously (``num_loadable_blocks``): the same."""
    a = LLM(str(tiny_llama), kv_tier=tier, **OPTIONS)
    b = LLM(str(tiny_llama), kv_tier=tier, **OPTIONS)
    try:
        want = a.generate([A], GREEDY)[0].outputs[0].token_ids
        assert a.engine.connector.flush(10.0)
        got = b.generate([S, A], GREEDY)
        assert got[1].outputs[0].token_ids == want
        assert b.engine.connector.flush(10.0)
        assert a.engine.connector.stats().blocks_saved == 6
        assert b.engine.connector.stats().blocks_saved == 0
        assert b.engine.connector.kv.tier.stats().entries == 6
    finally:
        a.close()
        b.close()


def test_a_pass_does_not_write_again_what_the_writer_holds(tiny_llama, private_redis, caplog) -> None:
    """A re-publication pass (here after a ``FLUSHALL``) asks Redis which prefix-cache blocks it
    lacks; a block that filled just before, whose write still waits in the writer, looks absent.
    Before, the pass queued it again: written twice. The writer's ``put_many`` is held by a hook
    (as a slow Redis would) so that the pass starts while those writes wait."""
    srv = private_redis()
    llm = LLM(str(tiny_llama), kv_tier=srv.url + "?timeout=5&flush_check=0.05", **OPTIONS)
    connector = llm.engine.connector
    tier = connector.kv.tier
    put_many = tier.put_many
    flowing = threading.Event()
    flowing.set()

    def held_put_many(items):  # noqa: ANN001, ANN202
        assert flowing.wait(30)
        return put_many(items)

    tier.put_many = held_put_many
    try:
        first = [(3 * i + 1) % 900 + 10 for i in range(5 * BLOCK)]  # 80 tokens: 5 full blocks
        second = [(7 * i + 4) % 900 + 10 for i in range(5 * BLOCK)]
        llm.generate([first], GREEDY)
        assert connector.flush(10.0) and connector.stats().blocks_saved == 5
        flowing.clear()
        llm.generate([second], GREEDY)  # its 5 blocks' writes wait in the writer
        assert connector.stats().pending_writes == 5
        redis.Redis(port=srv.port).flushall()  # the first prompt's blocks are gone
        republisher = connector.republisher
        caplog.set_level(logging.INFO, logger="kvcache.republish")
        deadline = time.monotonic() + 20
        while not (republisher.passes == 1 and not republisher.active):
            assert time.monotonic() < deadline, "no pass ran"
            llm.engine.step()
        assert republisher.last_outcome == "done"
        flowing.set()
        assert connector.flush(10.0)
        stats = connector.stats()
        # 5 + 5 written as they filled, the first prompt's 5 again: nothing twice.
        assert (stats.blocks_saved, stats.blocks_republished, stats.writes_dropped) == (15, 5, 0)
        fingerprint = llm.engine.model_fingerprint
        keys = {k.decode() for k in redis.Redis(port=srv.port).keys(f"ferry:kv:{fingerprint}:*")}
        assert keys == {tier_key(fingerprint, h) for p in (first, second) for h in block_hashes(p, BLOCK)}
        line = [r.getMessage() for r in caplog.records if "re-publication pass" in r.getMessage()][-1]
        assert "10 prefix-cache blocks checked, 5 lacked by the tier, 5 queued for writing" in line
    finally:
        flowing.set()
        llm.close()
