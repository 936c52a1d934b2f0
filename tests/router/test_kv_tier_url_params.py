"""The router reads the KV tier's URL as the replicas do: ferry's own parameters (``?ttl=``,
``?l1_bytes=`` …, kvcache/redis_tier.py) are not handed to redis-py, for the KV-event reader
(``--kv-tier``) and Redis discovery (``--discovery``, the same Redis in `ferry up` and the manifests)."""

from __future__ import annotations

from kvcache.events import KVEventPublisher
from kvcache.keys import block_hashes
from router.discovery import DiscoveredReplica
from router.discovery_redis import RedisDiscovery, replica_key, replica_value
from router.kv_events import KVEventFollower
from router.prefix_index import PrefixIndex

A = "http://127.0.0.1:9001"
PARAMS = "?ttl=600&l1_bytes=1000000&timeout=0.5&connect_timeout=0.5&max_connections=4&breaker_failures=2"


def test_kv_events_are_read_through_a_tier_url_with_its_parameters(redis_url: str) -> None:
    hs = block_hashes(list(range(32)), 16)
    publisher = KVEventPublisher(redis_url, "fp-params", replica_id=A)
    assert publisher.publish("stored", hs)
    index = PrefixIndex(100)
    follower = KVEventFollower(redis_url + PARAMS, index, known_url=lambda u: u == A)
    assert follower.poll_once() == 1
    assert index.match(hs, [A]) == {A: 2}
    publisher.close()


async def test_discovery_reads_a_tier_url_with_its_parameters(redis_url: str) -> None:
    import redis

    with redis.Redis.from_url(redis_url) as r:
        r.set(replica_key(A), replica_value(A, "decode", "m", 1.0), px=6000)
    discovery = RedisDiscovery(redis_url + PARAMS)
    try:
        assert await discovery.list_replicas() == [DiscoveredReplica(A, "decode", "m")]
    finally:
        await discovery.close()
