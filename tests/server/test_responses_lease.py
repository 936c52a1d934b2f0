"""Leases of background responses (``server/responses_lease.py``) in the stores: taken, renewed and
lapsed (the memory store by an injected clock, Redis by its own expiry), and a response that says it
runs with no lease saved as failed once, its log ended with ``response.failed``. A killed process's
responses reported failed through another replica, or another API server process: in
test_responses_store.py and test_api_servers.py."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import redis

from server.metrics import ServerMetrics
from server.responses_lease import ORPHANED_ERROR, Leases
from server.responses_memory import MemoryRecords
from server.responses_memory_stores import MemoryResponseStore
from server.responses_redis import RedisResponseStore
from server.responses_store import encode, event_frame

ORPHANED = "ferry:responses_background_orphaned_total"


def _record(status: str, **more) -> dict:
    return {"response": {"id": "r", "status": status, "error": None}, "input": [], **more}


def test_memory_leases_lapse_by_the_clock_and_an_orphan_fails_once() -> None:
    now = 100.0
    records = MemoryRecords(max_bytes=10**6, ttl_s=3600.0, clock=lambda: now)
    records.request_cancel("r")  # no record yet: no flag
    records.claim("r", 5.0)  # before its queued record, as BackgroundResponses.start does
    assert records.put("r", encode(_record("queued")))
    records.request_cancel("r")
    records.claim("r", 5.0)  # a later response of this id: the flag left by the earlier one goes
    assert records.cancel_requested(["r"]) == []
    failed = encode(_record("failed"))
    now = 104.9
    assert records.lease_held("r") and not records.replace_orphan("r", failed)
    records.renew_leases(["r"], 5.0)  # until 109.9
    now = 109.8
    assert records.lease_held("r") and not records.replace_orphan("r", failed)
    now = 109.9  # the instant it lapses
    assert not records.lease_held("r")
    assert records.replace_orphan("r", failed) and records.get("r") == failed
    assert not records.replace_orphan("r", encode(_record("failed", again=True)))  # once
    assert records.get("r") == failed
    # A finished response without a lease is never touched; nor is one with no record.
    assert records.put("done", encode(_record("completed")))
    assert not records.replace_orphan("done", failed) and not records.replace_orphan("none", failed)


def test_memory_leases_nobody_renews_are_dropped() -> None:
    now = 0.0
    records = MemoryRecords(max_bytes=10**6, ttl_s=3600.0, clock=lambda: now)
    records.claim("never-stored", 1.0)  # its record was not kept: no run renews it
    records.claim("deleted", 1.0)
    records.put("deleted", encode(_record("queued")))
    assert records.delete("deleted") and not records.lease_held("deleted")
    records.claim("mine", 1.0)
    now = 1.0
    records.renew_leases(["mine"], 1.0)  # any renewal sweeps the lapsed ones
    assert records._leases == {"mine": 2.0}
    assert records.events_end("mine") == 0  # no record, no events
    records.put("mine", encode(_record("in_progress", stream=True)))
    records.append_events("mine", 0, [b"a", b"b", b"c"])
    assert records.events_end("mine") == 3


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_a_store_lets_one_of_two_readers_fail_an_orphan(kind, redis_url) -> None:
    store = MemoryResponseStore(10**6, 60.0) if kind == "memory" else RedisResponseStore(redis_url, 60.0)
    try:
        # Leases long enough that no stall of a loaded machine lapses them before the test does.
        await store.claim("r", 60.0)
        await store.put("r", _record("in_progress"))
        assert await store.lease_held("r")
        await store.renew_leases(["r", "other"], 30.0)
        if kind == "redis":
            pttl = redis.Redis.from_url(redis_url).pttl("ferry:response-lease:r")
            assert 0 < pttl <= 30000  # the renewal's TTL, not the claim's
        assert not await store.replace_orphan("r", _record("failed"))
        await store.renew_leases(["r"], 0.3)  # renewed for the last time: lapses in 0.3 s
        deadline = time.monotonic() + 60
        while await store.lease_held("r"):
            assert time.monotonic() < deadline, "the lease never lapsed"
            await asyncio.sleep(0.05)
        one, two = _record("failed", by="one"), _record("failed", by="two")
        won = await asyncio.gather(store.replace_orphan("r", one), store.replace_orphan("r", two))
        assert sorted(won) == [False, True]
        assert await store.get("r") == (one if won[0] else two)
        await store.append_events("r", 0, [b"a", b"b"])
        assert await store.events_end("r") == 2
        await store.claim("r", 60.0)
        assert await store.delete("r") and not await store.lease_held("r")  # the lease goes too
        assert await store.events_end("r") == 0
    finally:
        await store.close()


async def test_settle_saves_an_orphan_failed_once_and_ends_its_stream() -> None:
    store = MemoryResponseStore(10**6, 60.0)
    metrics = ServerMetrics("m")
    leases = Leases(store, metrics, ttl_s=60.0)
    running = _record("in_progress", stream=True)
    frames = [event_frame("response.created", 0), event_frame("response.in_progress", 1)]
    await leases.claim("r")
    await store.put("r", running)
    await store.append_events("r", 0, frames)
    assert await leases.settle(running) is running  # its lease is held: it runs
    store.records._leases.clear()  # as if its process died a lease ago
    failed = await leases.settle(running)
    assert failed["response"]["status"] == "failed" and failed["response"]["error"] == ORPHANED_ERROR
    assert "the process running it stopped" in failed["response"]["error"]["message"]
    assert await store.get("r") == failed
    first, held = await store.read_events("r", -1)
    assert first == 0 and held[:2] == frames and len(held) == 3
    event = json.loads(held[2].split(b"data: ", 1)[1])
    assert held[2].startswith(b"event: response.failed\n")
    assert event == {"type": "response.failed", "sequence_number": 2, "response": failed["response"]}
    # A second reader of the stale record reads what the first wrote, and counts nothing.
    assert await leases.settle(running) == failed
    assert metrics.registry.get_sample_value(ORPHANED, {"model_name": "m"}) == 1
    assert (await store.read_events("r", -1))[1] == held
    await store.delete("r")
    assert await leases.settle(running) is None  # deleted meanwhile
