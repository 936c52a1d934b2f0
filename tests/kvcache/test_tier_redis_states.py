"""The Redis tier under the states managed Redis goes through while it still answers.

Real tiny Llama, real redis-server put in each state by its own commands:

* ``CLIENT PAUSE … WRITE`` (a managed failover or upgrade): lookups only read, so they must go on
  (the lookup script declares ``#!lua flags=no-writes``; without it Redis holds it as a write).
* over ``maxmemory`` under ``noeviction`` (``OOM``), a read-only replica (``READONLY``, the old primary
  after a failover), writes stopped because RDB saves fail (``MISCONF``): the server refuses the
  writes but keeps the breaker closed. Each refused block is counted under its reason and written
  again by the re-publication pass once the refusal passed (after a back-off, never in a loop),
  while lookups and loads go on serving.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Callable

import pytest
import redis

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from kvcache import redis_tier
from kvcache import writer as writer_module
from kvcache.events import KVEventPublisher, KVEventReader
from kvcache.keys import block_hashes, tier_key
from kvcache.tier import open_tier
from tests.conftest import free_port

BLOCK = 16
PROMPT = [(11 * i + 5) % 900 + 10 for i in range(5 * BLOCK)]  # 80 tokens: 5 full blocks
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)  # 83 tokens with KV: still 5 full blocks
OPTIONS = {"block_size": BLOCK, "num_kv_blocks": 64, "deterministic": True}
# A call Redis holds fails after 2 s, so a held lookup shows as a miss, not as a long wait.
TIER_PARAMS = "?timeout=2&flush_check=0"
KEYS = [f"ferry:kv:fp:{i:02x}" for i in range(4)]


def _keys_in(port: int) -> set[str]:
    return {k.decode() for k in redis.Redis(port=port).keys("ferry:kv:*")}


def _step_until(llm: LLM, done: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        llm.engine.step()


def _generate(llm: LLM) -> tuple[list[int], int]:
    out = llm.generate([PROMPT], GREEDY)[0]
    return out.outputs[0].token_ids, out.num_cached_tokens


def test_lookups_answer_during_a_client_pause_write(tiny_llama, private_redis) -> None:
    srv = private_redis()
    url = srv.url + TIER_PARAMS
    tier = open_tier(url)
    assert tier.put_many([(k, b"v") for k in KEYS[:3]]) == [True] * 3
    a = LLM(str(tiny_llama), kv_tier=url, **OPTIONS)
    tokens, _ = _generate(a)
    assert a.engine.connector.flush(10.0)
    assert a.engine.connector.stats().blocks_saved == 5
    admin = redis.Redis(port=srv.port)
    admin.execute_command("CLIENT", "PAUSE", 20000, "WRITE")
    try:
        started = time.monotonic()
        assert tier.contains_prefix(KEYS) == 3
        assert tier.contains_prefix_many([KEYS, KEYS[:2], KEYS[3:]]) == [3, 2, 0]
        assert time.monotonic() - started < 1.0  # answered, not held until the timeout
        # Another replica admits the prompt meanwhile: its lookup finds the 4 blocks it may load
        # (and the last one, which it computes), it loads them and answers the same tokens.
        b = LLM(str(tiny_llama), kv_tier=url, **OPTIONS)
        assert _generate(b) == (tokens, 4 * BLOCK)
        stats = b.engine.connector.stats()
        assert (stats.blocks_looked_up, stats.blocks_loaded, stats.blocks_saved) == (5, 4, 0)
        assert stats.tier.errors.get("timeout", 0) == 0 and stats.tier.breaker_state == "closed"
        assert tier.stats().errors.get("timeout", 0) == 0
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
    a.close()
    b.close()
    tier.close()


def test_reads_of_a_ttl_tier_answer_during_a_client_pause_write(redis_url: str) -> None:
    """``?ttl=`` sets a read block's expiry again (an ``EXPIRE``, a write): that waits for the pause
    to end on its own thread, the read does not."""
    tier = open_tier(redis_url + "?ttl=30&timeout=2")
    assert tier.put_many([(k, b"v") for k in KEYS[:3]]) == [True] * 3
    admin = redis.Redis.from_url(redis_url)
    for key in KEYS[:3]:
        admin.pexpire(key, 20_000)  # as if written 10 s ago
    backend = tier.inner.inner
    admin.execute_command("CLIENT", "PAUSE", 20000, "WRITE")
    try:
        started = time.monotonic()
        assert tier.get_many(KEYS) == [b"v", b"v", b"v", None]
        assert tier.get_many(KEYS[1:3]) == [b"v", b"v"]
        assert time.monotonic() - started < 1.0
        assert tier.stats().errors.get("timeout", 0) == 0
        assert all(admin.pttl(key) <= 20_000 for key in KEYS[:3])  # not touched yet: held by the pause
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
    assert backend.wait_touched()
    assert all(28_000 < admin.pttl(key) <= 30_000 for key in KEYS[:3])
    assert admin.exists(KEYS[3]) == 0
    tier.close()


def test_kv_events_refused_by_a_full_redis_are_counted_and_logged_once(redis_url: str, caplog) -> None:
    admin = redis.Redis.from_url(redis_url)
    publisher = KVEventPublisher(redis_url, "fp", "replica-a")
    refuse = _oom(admin, None)
    try:
        assert [publisher.publish("stored", [bytes([i]) * 16]) for i in range(3)] == [False] * 3
    finally:
        refuse()
    assert publisher.errors.snapshot() == {"response": 3}
    lines = [r.getMessage() for r in caplog.records if "publishing KV events" in r.getMessage()]
    assert len(lines) == 1 and "(response; events are dropped meanwhile)" in lines[0]
    assert "maxmemory" in lines[0]
    time.sleep(1.05)  # three refusals in a row opened its breaker for a second
    assert publisher.publish("stored", [b"\x09" * 16])
    assert [e.seq for e in KVEventReader(redis_url, "fp").read()] == [4]  # the reader sees the gap
    publisher.close()


def test_a_redis_without_script_flags_runs_the_lookup_script_without_them(
    redis_url, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis before 7 cannot compile the ``#!lua`` shebang; here a flag Redis 7 does not know gets the
    same answer ("Unexpected flag in script shebang"): lookups still run the script, not EXISTS."""
    monkeypatch.setattr(
        redis_tier, "PREFIX_SCRIPT", "#!lua flags=no-such-flag\n" + redis_tier.PREFIX_SCRIPT_BODY
    )
    for many in (False, True):
        tier = redis_tier.RedisTier(redis_url)
        tier.put_many([(k, b"v") for k in KEYS[:2]])
        if many:
            assert tier.contains_prefix_many([KEYS, KEYS[1:]]) == [2, 1]
        else:
            assert tier.contains_prefix(KEYS) == 2
        assert tier._prefix_script is not None
        assert tier._prefix_script.script == redis_tier.PREFIX_SCRIPT_BODY
        tier.close()


def _oom(admin: redis.Redis, srv) -> Callable[[], None]:  # noqa: ANN001
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", 1)
    return lambda: admin.config_set("maxmemory", 0)


def _readonly(admin: redis.Redis, srv) -> Callable[[], None]:  # noqa: ANN001
    admin.replicaof("127.0.0.1", free_port())  # a primary that is not there: it keeps its data
    return lambda: admin.replicaof("NO", "ONE")


def _misconf(admin: redis.Redis, srv) -> Callable[[], None]:  # noqa: ANN001
    # The RDB file cannot replace a directory: the save fails, and with a save point configured
    # (stop-writes-on-bgsave-error, the default) Redis refuses writes until a save works again.
    blocker = srv.workdir / "dump.rdb"
    (blocker / "keep").mkdir(parents=True)
    admin.config_set("save", "3600 1")
    admin.bgsave()
    deadline = time.monotonic() + 10
    while admin.info("persistence")["rdb_last_bgsave_status"] != "err":
        assert time.monotonic() < deadline, "the save did not fail"
        time.sleep(0.02)

    def clear() -> None:
        shutil.rmtree(blocker)
        while admin.info("persistence")["rdb_bgsave_in_progress"]:
            time.sleep(0.02)
        admin.bgsave()
        deadline = time.monotonic() + 10
        while admin.info("persistence")["rdb_last_bgsave_status"] != "ok":
            assert time.monotonic() < deadline, "the save did not work"
            time.sleep(0.02)

    return clear


@pytest.mark.parametrize(
    ("reason", "refuse"), [("oom", _oom), ("readonly", _readonly), ("misconf", _misconf)]
)
def test_refused_writes_are_counted_and_written_again_once_redis_takes_them(
    tiny_llama, private_redis, metric, monkeypatch: pytest.MonkeyPatch, reason: str, refuse
) -> None:
    monkeypatch.setattr(writer_module, "REFUSED_RETRY_S", 0.5)
    srv = private_redis()
    url = srv.url + TIER_PARAMS
    admin = redis.Redis(port=srv.port)
    a = LLM(str(tiny_llama), kv_tier=url, **OPTIONS)
    connector = a.engine.connector
    republisher = connector.republisher
    before = metric("ferry:kv_tier_dropped_writes_total", reason=reason)
    lost = metric("ferry:kv_tier_dropped_writes_total", reason="tier")
    clear = refuse(admin, srv)

    # The prefill alone (one token): no engine step past it could start a retry before the asserts.
    out = a.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0.0))[0]
    assert out.num_cached_tokens == 0
    assert connector.flush(10.0)
    stats = connector.stats()
    assert (stats.blocks_saved, stats.writes_dropped) == (0, 5)
    assert metric("ferry:kv_tier_dropped_writes_total", reason=reason) - before == 5
    assert metric("ferry:kv_tier_dropped_writes_total", reason="tier") == lost
    assert stats.tier.breaker_state == "closed" and stats.tier.errors.get("response", 0) >= 1
    assert 0.0 < connector.kv.refused_retry_in() <= 0.5
    # Still refused when the retry is due: one more round (the pass checks the 5 blocks and queues
    # them; Redis refuses them again), then the wait doubles, no loop of writes meanwhile.
    _step_until(a, lambda: republisher.passes == 1 and not republisher.active)
    assert connector.flush(10.0)
    assert metric("ferry:kv_tier_dropped_writes_total", reason=reason) - before == 10
    assert 0.5 < connector.kv.refused_retry_in() <= 1.0
    assert republisher.passes == 1 and _keys_in(srv.port) == set()

    clear()
    _step_until(a, lambda: republisher.passes == 2 and not republisher.active)
    assert connector.flush(10.0)
    assert republisher.last_outcome == "done"
    expected = {tier_key(a.engine.model_fingerprint, h) for h in block_hashes(PROMPT, BLOCK)}
    assert len(expected) == 5 and _keys_in(srv.port) == expected
    stats = connector.stats()
    assert (stats.blocks_saved, stats.blocks_republished, stats.writes_dropped) == (5, 5, 10)
    assert connector.kv.refused_retry_in() is None and not republisher.has_work()
    # Another replica loads the prefix and answers the tokens this one computes.
    tokens, cached = _generate(a)
    assert cached == 4 * BLOCK  # its own prefix cache
    b = LLM(str(tiny_llama), kv_tier=url, **OPTIONS)
    assert _generate(b) == (tokens, 4 * BLOCK)
    assert b.engine.connector.stats().blocks_loaded == 4
    a.close()
    b.close()


async def test_an_idle_async_engine_writes_refused_blocks_once_redis_takes_them(
    tiny_llama, private_redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No request arrives after the refusal: the loop wakes when the retry is due (and only then),
    not at the next request."""
    monkeypatch.setattr(writer_module, "REFUSED_RETRY_S", 0.4)
    srv = private_redis()
    admin = redis.Redis(port=srv.port)
    eng = AsyncEngine(EngineConfig(model=str(tiny_llama), kv_tier=srv.url + TIER_PARAMS, **OPTIONS))
    connector = eng.engine.connector
    steps = [0]
    step = connector.step

    def counted() -> None:
        steps[0] += 1
        step()

    try:
        clear = _oom(admin, srv)
        async for _ in eng.generate("refused", PROMPT, SamplingParams(max_tokens=1, temperature=0.0)):
            pass
        assert connector.flush(10.0)
        assert connector.stats().writes_dropped == 5
        connector.step = counted
        clear()
        deadline = time.monotonic() + 20
        while connector.stats().blocks_republished < 5:
            assert time.monotonic() < deadline, "the idle engine did not write the refused blocks"
            await asyncio.sleep(0.05)
        expected = {tier_key(eng.engine.model_fingerprint, h) for h in block_hashes(PROMPT, BLOCK)}
        assert _keys_in(srv.port) == expected
        assert 1 <= steps[0] <= 20, steps[0]  # woken for the retry and its pass, no 50 ms spin
    finally:
        await asyncio.wait_for(eng.shutdown(), 30)
