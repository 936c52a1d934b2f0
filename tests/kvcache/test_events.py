"""Block events on the per-model Redis stream: publish, read, fold into a prefix index."""

from __future__ import annotations

import redis
import torch

from kvcache.connector import KVConnector
from kvcache.events import KVEventPublisher, KVEventReader, PrefixIndex, events_stream
from kvcache.keys import block_hashes

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
