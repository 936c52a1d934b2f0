"""``--register``'s heartbeat against a real Redis that fills up, and its deregistration: a full
Redis must not let a serving replica's registration expire, and a clean stop says so explicitly
(routers remove at once a replica that deregistered; one whose key merely vanished, they keep
while their health probes pass: router/discovery_sync.py)."""

from __future__ import annotations

import asyncio
import json

import redis

from server.registration import Registration, departed_key, replica_key

URL = "http://127.0.0.1:9401"


def _fill(r: redis.Redis) -> None:
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", 1)  # every write that may grow memory (SET) is refused from now on


async def test_a_full_redis_keeps_the_registration_alive(private_redis) -> None:
    srv = private_redis()
    registration = Registration(srv.url, URL, "mixed", "m", interval_s=0.2, ttl_s=1.0)
    await registration.start()
    with redis.Redis(port=srv.port) as r:
        try:
            _fill(r)
            await asyncio.sleep(1.6)  # well past the TTL: only refreshed keys are left
            assert r.exists(replica_key(URL)), "expired while the replica serves"
            assert json.loads(r.get(replica_key(URL)))["url"] == URL
        finally:
            await registration.stop()
        # Still full: the deregistration is refused, the key is deleted all the same.
        assert not r.exists(replica_key(URL)) and not r.exists(departed_key(URL))


async def test_a_clean_stop_deregisters_and_the_next_start_clears_it(private_redis) -> None:
    srv = private_redis()
    registration = Registration(srv.url, URL, "prefill", "m")
    await registration.start()
    await registration.stop()
    with redis.Redis(port=srv.port) as r:
        assert not r.exists(replica_key(URL))
        assert json.loads(r.get(departed_key(URL)))["url"] == URL
        assert 55_000 < r.pttl(departed_key(URL)) <= 60_000
        again = Registration(srv.url, URL, "prefill", "m")  # the same URL, restarted
        await again.start()
        try:
            assert r.exists(replica_key(URL)) and not r.exists(departed_key(URL))
        finally:
            await again.stop()
