"""A replica's other Redis clients take the KV tier's URL with its parameters (``?ttl=``,
``?l1_bytes=`` …), as `ferry up` and the manifests pass it: the Responses store
(``--responses-store``) and the registration (``--register``). redis-py is never handed them."""

from __future__ import annotations

import redis

from server.registration import Registration, replica_key
from server.responses_redis import RedisResponseStore

PARAMS = "?ttl=600&l1_bytes=1000000&timeout=0.5&breaker_cooldown=2"


async def test_the_responses_store_takes_a_tier_url(redis_url: str) -> None:
    store = RedisResponseStore(redis_url + PARAMS, ttl_s=60)
    record = {"response": {"id": "resp_1", "status": "completed"}, "input": []}
    assert await store.put("resp_1", record)
    assert await store.get("resp_1") == record


async def test_the_registration_takes_a_tier_url(redis_url: str) -> None:
    url = "http://127.0.0.1:9301"
    registration = Registration(redis_url + PARAMS, url, "mixed", "m")
    await registration.start()
    with redis.Redis.from_url(redis_url) as r:
        try:
            assert r.exists(replica_key(url))
        finally:
            await registration.stop()
        assert not r.exists(replica_key(url))
