"""Redis discovery when Redis loses registrations: a restarted, full or hung Redis must not take
healthy replicas out of the router; a replica that deregisters, whose heartbeat alone stops, or that
fails its health probes still goes. ``DiscoverySync`` over a real redis-server, on a fake clock,
the replicas' health set as the prober would (``router/discovery_sync.py`` has the rule)."""

from __future__ import annotations

import json
import time

import redis

from router.discovery_redis import RedisDiscovery, departed_key, replica_key, replica_value
from router.discovery_sync import DiscoverySync
from router.pool import Replicas
from router.replica import Health

A, B = "http://127.0.0.1:9101", "http://127.0.0.1:9102"
INTERVAL = 1.0
GRACE = 2.0 + INTERVAL  # a heartbeat interval and a poll


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Harness:
    def __init__(self, srv) -> None:
        self.srv = srv
        self.clock = Clock()
        self.replicas = Replicas(clock=self.clock)
        self.sync = DiscoverySync(RedisDiscovery(srv.url), self.replicas, INTERVAL, clock=self.clock)

    def redis(self) -> redis.Redis:
        return redis.Redis(port=self.srv.port)

    def beat(self, *urls: str) -> None:
        """What a replica's heartbeat writes."""
        with self.redis() as r:
            for url in urls:
                r.set(replica_key(url), replica_value(url, "mixed", "m", 1.0), px=6000)

    async def poll(self, dt: float = INTERVAL) -> set[str]:
        """One discovery round ``dt`` after the last (as ``DiscoverySync._run`` runs it); the URLs after it."""
        self.clock.t += dt
        try:
            await self.sync.sync_once()
        except redis.RedisError:
            self.sync.source_failed()
        for r in self.replicas:
            if r.health is Health.STARTING:
                r.health = Health.HEALTHY  # the prober found it healthy
        return {r.url for r in self.replicas}

    async def __aenter__(self) -> Harness:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.sync.stop()


async def test_a_restarted_redis_keeps_healthy_replicas(private_redis) -> None:
    async with Harness(private_redis()) as h:
        h.beat(A, B)
        assert await h.poll() == {A, B}
        h.srv.stop()
        assert await h.poll() == {A, B}  # unreachable: the previous view
        h.srv.start()  # same port, no data: every registration is gone at once
        for _ in range(10):  # however long the replicas take to write theirs again
            assert await h.poll() == {A, B}
        h.beat(A)
        assert await h.poll() == {A, B}  # registrations are written again: B has GRACE to come back
        assert await h.poll() == {A, B}
        h.beat(A, B)
        assert await h.poll() == {A, B}
        assert h.sync._missing == {}


async def test_a_heartbeat_that_stops_while_the_others_land_removes_its_replica(private_redis) -> None:
    async with Harness(private_redis()) as h:
        h.beat(A, B)
        assert await h.poll() == {A, B}
        with h.redis() as r:
            r.delete(replica_key(B))  # B's key expired; A's heartbeats go on
        kept_until = h.clock.t + INTERVAL + GRACE
        while h.clock.t + INTERVAL < kept_until:
            h.beat(A)
            assert await h.poll() == {A, B}
        h.beat(A)
        assert await h.poll() == {A}


async def test_a_full_redis_that_lost_the_keys_keeps_replicas_while_their_probes_pass(private_redis) -> None:
    async with Harness(private_redis()) as h:
        h.beat(A, B)
        assert await h.poll() == {A, B}
        with h.redis() as r:
            r.config_set("maxmemory-policy", "noeviction")
            r.config_set("maxmemory", 1)  # heartbeats refused from now on
            r.delete(replica_key(A), replica_key(B))
        for _ in range(10):
            assert await h.poll() == {A, B}
        h.replicas.find(B).health = Health.EJECTED  # B really went away: its probes fail
        assert await h.poll() == {A}


async def test_a_replica_gone_missing_and_failing_its_probes_is_removed_after_the_grace(
    private_redis,
) -> None:
    async with Harness(private_redis()) as h:
        h.beat(A)
        assert await h.poll() == {A}
        with h.redis() as r:
            r.delete(replica_key(A))  # killed: its key expired
        h.replicas.find(A).health = Health.EJECTED
        assert await h.poll() == {A}  # a registration may still come back
        assert await h.poll(GRACE - INTERVAL) == {A}
        assert await h.poll() == set()


async def test_a_deregistered_replica_is_removed_at_once(private_redis) -> None:
    async with Harness(private_redis()) as h:
        h.beat(A, B)
        assert await h.poll() == {A, B}
        with h.redis() as r:  # what a draining replica writes (server/registration.py)
            r.set(departed_key(A), json.dumps({"url": A, "left": time.time()}), px=60000)
            r.delete(replica_key(A))
        assert h.replicas.find(A).health is Health.HEALTHY
        assert await h.poll(0.1) == {B}
        h.beat(A)  # the same URL registered again (restarted): listed wins over a stale deregistration
        assert await h.poll() == {A, B}
