"""Block events on the per-model Redis stream: publish, read, fold into a prefix index."""

from __future__ import annotations

import time

import redis
import torch

from kvcache import writer as writer_module
from kvcache.connector import KVConnector
from kvcache.events import KVEventPublisher, KVEventReader, PrefixIndex, events_stream
from kvcache.keys import block_hashes
from kvcache.tier import open_tier
from kvcache.writer import BlockEvent, BlockWrite, BlockWriter

HASHES = block_hashes(list(range(16 * 6)), 16)
HEX = [h.hex() for h in HASHES]


def test_publish_read_and_index(redis_url: str) -> None:
    a = KVEventPublisher(redis_url, "fp", "replica-a", maxlen=1000)
    b = KVEventPublisher(redis_url, "fp", "replica-b")
    other_model = KVEventPublisher(redis_url, "other", "replica-a")
    assert a.publish("stored", HASHES[:4])
    assert b.publish("stored", HASHES[:2])
    assert a.publish("removed", HASHES[3:4])
    assert b.publish("stored", HASHES[:3], medium="tier")
    assert other_model.publish("stored", HASHES)
    assert a.publish("stored", []) is True  # nothing to say: no entry written
    reader = KVEventReader(redis_url, "fp")
    events = reader.read()
    assert [(e.kind, e.replica_id, e.medium, e.block_hashes) for e in events] == [
        ("stored", "replica-a", "device", tuple(HEX[:4])),
        ("stored", "replica-b", "device", tuple(HEX[:2])),
        ("removed", "replica-a", "device", (HEX[3],)),
        ("stored", "replica-b", "tier", tuple(HEX[:3])),
    ]
    index = PrefixIndex()
    index.apply_all(events)
    assert index.device_prefix(HEX) == {"replica-a": 3, "replica-b": 2}
    assert index.tier_prefix(HEX) == 3
    assert reader.read() == []  # nothing new
    a.publish("cleared", [])
    index.apply_all(reader.read())
    assert index.device_prefix(HEX) == {"replica-a": 0, "replica-b": 2}
    assert redis.Redis.from_url(redis_url).xlen(events_stream("fp")) == 5


def test_reader_from_now_skips_history(redis_url: str) -> None:
    pub = KVEventPublisher(redis_url, "fp", "r")
    pub.publish("stored", HASHES[:1])
    reader = KVEventReader(redis_url, "fp", start_id="$")
    pub.publish("stored", HASHES[1:2])
    assert [e.block_hashes for e in reader.read()] == [(HEX[1],)]


def test_publisher_never_raises_when_redis_is_down() -> None:
    pub = KVEventPublisher("redis://127.0.0.1:1/0", "fp", "r", timeout=0.2)
    assert pub.publish("stored", HASHES[:1]) is False
    assert pub.errors.snapshot() == {"connection": 1}


def test_connector_publishes_tier_writes_and_device_events(redis_url: str) -> None:
    k = [torch.randn(4, 16, 2, 8) for _ in range(2)]
    v = [torch.randn(4, 16, 2, 8) for _ in range(2)]
    with KVConnector(
        redis_url + "?ttl=60", "fp", (2, 2, 16, 2, 8), torch.float32, events=True, replica_id="rep-1"
    ) as conn:
        conn.save_many(HASHES[:2], [0, 1], k, v)
        assert conn.flush(5.0)
        assert conn.publish_event("removed", HASHES[:1], medium="device")
        assert conn.flush(5.0)
    events = KVEventReader(redis_url, "fp").read()
    assert [(e.kind, e.replica_id, e.medium, e.block_hashes) for e in events] == [
        ("stored", "rep-1", "tier", tuple(HEX[:2])),
        ("removed", "rep-1", "device", (HEX[0],)),
    ]
    with KVConnector("memory://", "fp", (2, 2, 16, 2, 8), torch.float32) as plain:
        assert plain.events_enabled is False and plain.publish_event("stored", HASHES[:1]) is False


def test_the_events_publisher_connects_with_the_tiers_client_settings(redis_url: str) -> None:
    """The events publisher takes the tier URL's redis-py settings (client_name here; TLS ones
    alike) and drops only ferry's own tier parameters."""
    k = [torch.randn(4, 16, 2, 8) for _ in range(2)]
    v = [torch.randn(4, 16, 2, 8) for _ in range(2)]
    url = redis_url + "?ttl=60&client_name=ferry-events-test"
    with KVConnector(url, "fp", (2, 2, 16, 2, 8), torch.float32, events=True, replica_id="r") as conn:
        conn.save_many(HASHES[:1], [0], k, v)
        assert conn.flush(5.0)
        names = [c["name"] for c in redis.Redis.from_url(redis_url).client_list()]
        # One connection for the tier's write, one for the event it published.
        assert names.count("ferry-events-test") == 2, names


def test_events_past_the_write_queue_headroom_leave_a_numbered_gap(private_redis, monkeypatch) -> None:
    """A slow tier fills the write queue: events still queue in their own headroom past the writes'
    capacity; past that an event is missed, and the next one published numbers past it, so a reader
    sees the gap (router/kv_events.py drops and relearns the replica) instead of a stale view."""
    monkeypatch.setattr(writer_module, "EVENT_HEADROOM", 3)
    hashes = block_hashes(list(range(16 * 7)), 16)
    hexes = [h.hex() for h in hashes]
    srv = private_redis()
    tier = open_tier(srv.url + "?timeout=20")  # a paused SET waits, it does not fail
    publisher = KVEventPublisher(srv.url, "fp", "rep-1", timeout=20)
    writer = BlockWriter(tier, "fp", capacity=1, publisher=publisher)
    try:
        assert writer.submit_event(BlockEvent("stored", (hashes[0],), "device"))
        assert writer.flush(5.0)
        admin = redis.Redis(port=srv.port)
        admin.execute_command("CLIENT", "PAUSE", 20000, "WRITE")
        try:
            assert writer.reserve(1) == 1
            writer.submit([BlockWrite(hashes[1], torch.zeros(1, 2, 16, 1, 2))])
            deadline = time.monotonic() + 10
            while writer._queue:  # the write is taken: the writer waits on the paused SET
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert writer.reserve(1) == 0  # the writes' one slot is taken
            accepted = [
                writer.submit_event(BlockEvent(kind, (hashes[i],), "device"))
                for i, kind in enumerate(["stored", "removed", "stored", "removed", "stored"], start=2)
            ]
            assert accepted == [True, True, True, False, False] and writer.events_missed == 2
        finally:
            admin.execute_command("CLIENT", "UNPAUSE")
        assert writer.flush(10.0)
        events = KVEventReader(srv.url, "fp").read()
        assert [(e.seq, e.kind, e.medium, e.block_hashes) for e in events] == [
            (1, "stored", "device", (hexes[0],)),
            # The two missed events are numbered 2 and 3, before the writer's next events.
            (4, "stored", "tier", (hexes[1],)),
            (5, "stored", "device", (hexes[2],)),
            (6, "removed", "device", (hexes[3],)),
            (7, "stored", "device", (hexes[4],)),
        ]
        assert writer.counts()[:3] == (1, 0, 0)  # the write landed; nothing else pending
    finally:
        writer.close(5.0)
        publisher.close()
        tier.close()
