"""What the memory response store (``MemoryRecords``) keeps beyond its records: a background
response's lease goes with its final record (it was left until a renewal, which only another
running response makes), and ``bytes`` counts the fixed overheads of records, indexed items and
events, so that ``--responses-store-max-bytes`` bounds the memory really held (within 10 %)."""

from __future__ import annotations

import gc
import tracemalloc
import uuid
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from server.engine_client import EngineClient
from server.engine_host import EngineHost
from server.responses_memory import (
    EVENT_LOG_OVERHEAD,
    EVENT_OVERHEAD,
    ITEM_OVERHEAD,
    RECORD_OVERHEAD,
    MemoryRecords,
)
from server.responses_memory_stores import MemoryResponseStore, RemoteResponseStore
from server.responses_store import encode, event_frame
from tests.server.test_engine_ipc import _hosted


def _record(rid: str, status: str, items: tuple[str, ...] = ()) -> dict:
    output = [{"id": item, "type": "message", "content": []} for item in items]
    return {"response": {"id": rid, "status": status, "output": output}, "input": []}


# -- leases ------------------------------------------------------------------------------------


def test_a_finished_runs_lease_goes_with_its_final_record() -> None:
    now = 0.0
    records = MemoryRecords(max_bytes=10**6, ttl_s=3600.0, clock=lambda: now)
    records.claim("a", 5.0)
    records.claim("b", 5.0)
    assert records.put("a", encode(_record("a", "queued")))
    assert records.put("b", encode(_record("b", "in_progress")), ended=False)
    assert records.put("a", encode(_record("a", "in_progress")))
    assert records._leases == {"a": 5.0, "b": 5.0}
    assert records.put("a", encode(_record("a", "completed")), ended=True)
    assert records._leases == {"b": 5.0}  # at once: no renewal came in between
    now = 10.0  # b's process died: its lease lapsed; a reader saves it failed, lease and all
    assert records.replace_orphan("b", encode(_record("b", "failed")))
    assert records._leases == {}
    records.claim("big", 5.0)  # its queued record is refused: the run never starts
    assert not records.put("big", b"x" * 10**6)
    assert records._leases == {}


async def test_the_stores_tell_the_records_when_a_run_ended() -> None:
    store = MemoryResponseStore(max_bytes=10**6, ttl_s=3600.0)
    for status in ("queued", "in_progress", "completed", "failed", "cancelled", "incomplete"):
        await store.claim("r", 5.0)
        await store.put("r", _record("r", status))
        assert list(store.records._leases) == (["r"] if status in ("queued", "in_progress") else []), status


@pytest_asyncio.fixture(loop_scope="function")
async def engine(tiny_llama) -> AsyncIterator[AsyncEngine]:
    eng = AsyncEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=64))
    yield eng
    await eng.shutdown()


@pytest.mark.asyncio(loop_scope="function")
async def test_an_api_servers_final_record_gives_the_lease_back(engine) -> None:
    # As with --api-server-count: the API server's store is the engine process's, over the socket.
    records = MemoryRecords(max_bytes=10**6, ttl_s=3600.0)
    async with _hosted(EngineHost(engine, records)) as path:
        client = await EngineClient.connect(path)
        try:
            store = RemoteResponseStore(client)
            await store.claim("r", 5.0)
            await store.put("r", _record("r", "queued"))
            assert list(records._leases) == ["r"]
            await store.put("r", _record("r", "completed"))
            assert records._leases == {}
        finally:
            await client.shutdown()


# -- bytes -------------------------------------------------------------------------------------


def test_bytes_count_each_record_item_and_event() -> None:
    records = MemoryRecords(max_bytes=10**6, ttl_s=3600.0)
    one = encode(_record("resp_1", "completed", ("msg_1", "msg_2")))
    assert records.put("resp_1", one, ["msg_1", "msg_2"])
    expected = RECORD_OVERHEAD + 6 + len(one) + 2 * (ITEM_OVERHEAD + 5)
    assert records.bytes == expected
    assert records.put("resp_1", one, ["msg_1", "msg_2"])  # replaced: its items are not counted twice
    assert records.bytes == expected
    # A later record holding msg_2 too: both records' index entries exist, so both count.
    two = encode(_record("resp_2", "completed", ("msg_2", "msg_3")))
    assert records.put("resp_2", two, ["msg_2", "msg_3"])
    expected += RECORD_OVERHEAD + 6 + len(two) + 2 * (ITEM_OVERHEAD + 5)
    assert records.bytes == expected
    frames = [event_frame("response.output_text.delta", i, delta="x") for i in range(3)]
    records.append_events("resp_2", 0, frames)
    expected += EVENT_LOG_OVERHEAD + sum(len(f) + EVENT_OVERHEAD for f in frames)
    assert records.bytes == expected
    assert records.delete("resp_2")
    assert records.bytes == RECORD_OVERHEAD + 6 + len(one) + 2 * (ITEM_OVERHEAD + 5)
    assert records.delete("resp_1") and records.bytes == 0
    # A record whose overheads pass the bound is refused, though its JSON alone fits.
    small = MemoryRecords(max_bytes=RECORD_OVERHEAD + 1 + 10, ttl_s=3600.0)
    assert small.put("r", b"x" * 10) and small.bytes == small.max_bytes
    assert not small.put("r", b"x" * 10, ["i"]) and small.bytes == 0


RECORDS = 1_500  # past max_bytes, whatever the items


@pytest.mark.parametrize("n_items", [0, 3, 10])
def test_the_bound_holds_for_the_memory_really_held(n_items: int) -> None:
    """Small records with ``n_items`` items each, as the engine process receives them (fresh id strings
    and bytes), past the bound: what stays allocated is within 10 % of ``max_bytes``."""
    max_bytes = 1 << 19
    gc.collect()
    tracemalloc.start()
    try:
        records = MemoryRecords(max_bytes=max_bytes, ttl_s=3600.0)
        base = tracemalloc.get_traced_memory()[0]
        for _ in range(RECORDS):
            rid = f"resp_{uuid.uuid4().hex}{uuid.uuid4().hex[:16]}"
            items = tuple(f"msg_{uuid.uuid4().hex}{uuid.uuid4().hex[:16]}" for _ in range(n_items))
            records.put(rid, encode(_record(rid, "completed", items)), list(items))
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert len(records) < RECORDS  # the bound was reached: records were dropped
    assert records.bytes <= max_bytes
    assert held <= max_bytes * 1.1, f"{held} bytes held for a bound of {max_bytes}"
