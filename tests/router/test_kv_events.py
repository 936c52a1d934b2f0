"""cache_aware learns what replicas hold from their KV block events on a real Redis stream."""

from __future__ import annotations

from kvcache.events import KVEventPublisher
from kvcache.keys import block_hashes
from router.kv_events import KVEventFollower
from router.prefix_index import PrefixIndex

A, B = "http://127.0.0.1:9001", "http://127.0.0.1:9002"


def test_device_events_of_known_replicas_update_the_index(redis_url: str) -> None:
    hs = block_hashes(list(range(64)), 16)  # 4 blocks
    pub_a = KVEventPublisher(redis_url, "fp1", replica_id=A)
    pub_b = KVEventPublisher(redis_url, "fp1", replica_id=B)
    stranger = KVEventPublisher(redis_url, "fp1", replica_id="host:123")
    assert pub_a.publish("stored", hs[:3]) and pub_b.publish("stored", hs[:1])
    assert stranger.publish("stored", hs)
    assert pub_a.publish("stored", hs, medium="tier")  # tier blocks: every replica can load them

    index = PrefixIndex(100)
    follower = KVEventFollower(redis_url, index, known_url=lambda u: u in (A, B))
    assert follower.poll_once() == 2
    assert index.match(hs, [A, B]) == {A: 3, B: 1}
    assert follower.skipped == 1

    assert pub_a.publish("removed", hs[1:2])
    assert pub_b.publish("cleared", [])
    assert follower.poll_once() == 2
    assert index.match(hs, [A, B]) == {A: 1, B: 0}
    assert follower.poll_once() == 0  # nothing new: nothing re-applied
    index.check_integrity()
    for p in (pub_a, pub_b, stranger):
        p.close()
