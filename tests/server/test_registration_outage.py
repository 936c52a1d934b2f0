"""``--register``'s heartbeat against a real Redis that fills up, and its deregistration: a full
Redis must not let a serving replica's registration expire, and a clean stop says so explicitly
(routers remove at once a replica that deregistered; one whose key merely vanished, they keep
while their health probes pass: router/discovery_sync.py)."""

from __future__ import annotations

import asyncio
import json
import random
import time

import redis

from server.registration import Registration, departed_key, replica_key
from tests.conftest import free_port

URL = "http://127.0.0.1:9401"


def _fill(r: redis.Redis) -> None:
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", 1)  # every write that may grow memory (SET) is refused from now on


async def test_a_full_redis_keeps_the_registration_alive(private_redis) -> None:
    srv = private_redis()
    registration = Registration(srv.url, URL, "mixed", "m", interval_s=0.2, ttl_s=5.0)
    await registration.start()
    with redis.Redis(port=srv.port) as r:
        try:
            _fill(r)
            # Every SET refused: the key's TTL seen going up is a refresh that kept it (without
            # one it only goes down, to its expiry), however late a loaded machine runs the beat.
            lowest = r.pttl(replica_key(URL))
            deadline = time.monotonic() + 60
            while (now := r.pttl(replica_key(URL))) <= lowest:
                assert now > 0, "expired while the replica serves"
                assert time.monotonic() < deadline, "never refreshed"
                lowest = now
                await asyncio.sleep(0.02)
            assert json.loads(r.get(replica_key(URL)))["url"] == URL
        finally:
            await registration.stop()
        # Still full: the deregistration is refused, the key is deleted all the same.
        assert not r.exists(replica_key(URL)) and not r.exists(departed_key(URL))


async def test_a_read_only_redis_makes_the_heartbeat_connect_again(private_redis, caplog) -> None:
    """After a failover the old primary is a read-only replica: the heartbeat drops its connection
    after a refused beat (the next one resolves the endpoint again), logs once, and registers again
    as soon as the server takes writes."""
    srv = private_redis()
    registration = Registration(srv.url, URL, "mixed", "m", interval_s=0.05, ttl_s=5.0)
    await registration.start()
    with redis.Redis(port=srv.port) as r:
        try:
            r.replicaof("127.0.0.1", free_port())  # an absent primary: it keeps its data, refuses writes
            connections = r.info("stats")["total_connections_received"]
            await asyncio.sleep(0.5)  # about ten beats, each refused
            # Each refused beat ended its connection: the next ones were new (not one reused).
            assert r.info("stats")["total_connections_received"] - connections >= 3
            refused = [m for m in caplog.messages if "replica heartbeat" in m and "refused" in m]
            assert len(refused) == 1 and "read only replica" in refused[0]
            r.replicaof("NO", "ONE")
            r.delete(replica_key(URL))
            deadline = time.monotonic() + 10
            while not r.exists(replica_key(URL)):
                assert time.monotonic() < deadline, "not registered again"
                await asyncio.sleep(0.02)
        finally:
            await registration.stop()


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


async def test_stop_ends_the_heartbeat_even_when_redis_py_swallows_the_cancel(private_redis) -> None:
    # A cancel that lands while a refused SET's reply is read comes out of redis-py as the
    # ResponseError (measured with redis-py 8.2), which the beat logs and beats on: stop() waited
    # forever (a hung CI run, and a replica's drain). Beating every millisecond against a full
    # Redis and stopping at assorted moments hit it within a few stops; every stop must end.
    srv = private_redis()
    rng = random.Random(0)
    with redis.Redis(port=srv.port) as r:
        for attempt in range(30):
            r.config_set("maxmemory", 0)
            registration = Registration(srv.url, URL, "mixed", "m", interval_s=0.001, ttl_s=5.0)
            await registration.start()
            _fill(r)
            await asyncio.sleep(rng.random() * 0.05)
            stop = asyncio.ensure_future(registration.stop())
            done, _ = await asyncio.wait({stop}, timeout=10)
            assert stop in done, f"stop #{attempt} still waits on a heartbeat that beats on"
            stop.result()
            assert registration._task is None and not r.exists(replica_key(URL))
