"""Real replicas registered in a real Redis, a real router discovering them: a Redis that restarts,
fills up or loses the keys must not take a healthy replica out of the router; a replica that shuts
down cleanly still leaves it at once. Every URL is the KV tier's, parameters and all (what `ferry up`
passes): --register, --discovery and the router's --kv-tier read it as a tier URL."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import httpx
import pytest
import redis
from router_harness import Cluster, Proc, replicas_view, wait_until

from router.discovery_redis import FRESH_PTTL_MS, departed_key, replica_key
from tests.conftest import RedisServer

PARAMS = "?ttl=600&l1_bytes=1000000&timeout=0.5"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    srv = RedisServer(tmp_path_factory.mktemp("discovery-redis"))
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def setup(cluster: Cluster, store: RedisServer) -> tuple[list[Proc], Proc]:
    url = store.url + PARAMS
    replicas = cluster.replicas(2, "--register", url)
    router = cluster.router("--discovery", url, "--discovery-interval", "0.2", "--kv-tier", url)
    assert wait_until(lambda: _routable(router) == {r.url for r in replicas}, timeout=60)
    return replicas, router


@pytest.fixture
def admin(store: RedisServer) -> Iterator[redis.Redis]:
    r = redis.Redis(port=store.port)
    yield r
    r.config_set("maxmemory", 0)  # not full any more
    r.close()


def _routable(router: Proc) -> set[str]:
    return {url for url, r in replicas_view(router).items() if r["routable"]}


def _watch(router: Proc, urls: set[str], seconds: float) -> None:
    """Every replica stays in the router and routable for ``seconds``; requests keep being served."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert _routable(router) == urls
        answer = httpx.post(
            router.url + "/v1/completions",
            json={"model": "llama", "prompt": "a", "max_tokens": 1},
            timeout=10,
        )
        assert answer.status_code == 200, answer.text
        time.sleep(0.1)


def _registered(admin: redis.Redis, replicas: list[Proc]) -> bool:
    return all(admin.exists(replica_key(r.url)) for r in replicas)


def test_a_redis_restart_keeps_every_replica(setup, store: RedisServer, admin: redis.Redis) -> None:
    replicas, router = setup
    urls = {r.url for r in replicas}
    store.stop()
    store.start()  # same port, no data: every registration gone at once
    _watch(router, urls, 3.0)
    assert wait_until(lambda: _registered(admin, replicas), timeout=60)  # the heartbeats write them again
    assert "unexpected keyword argument" not in router.log.read_text()  # the --kv-tier URL's parameters


def test_a_full_redis_keeps_the_registrations_alive(setup, admin: redis.Redis) -> None:
    replicas, router = setup
    assert wait_until(lambda: _registered(admin, replicas), timeout=60)
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", 1)  # every SET refused from now on
    # Each key's TTL seen going up: refreshed by a heartbeat although every SET is refused (without
    # one a TTL only goes down), however late a loaded machine runs the beats.
    lowest = {r.url: admin.pttl(replica_key(r.url)) for r in replicas}
    assert min(lowest.values()) > FRESH_PTTL_MS, lowest

    went_up: set[str] = set()

    def refreshed() -> bool:
        for url in lowest:
            now = admin.pttl(replica_key(url))
            if now > lowest[url]:
                went_up.add(url)
            lowest[url] = min(lowest[url], now)
        return went_up == set(lowest)

    assert wait_until(refreshed, timeout=60), lowest
    assert _routable(router) == {r.url for r in replicas}


def test_registrations_lost_while_redis_is_full_keep_their_replicas(setup, admin: redis.Redis) -> None:
    replicas, router = setup
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", 1)
    admin.delete(*(replica_key(r.url) for r in replicas))  # and the replicas cannot write them again
    _watch(router, {r.url for r in replicas}, 3.0)  # past the grace of a heartbeat interval
    admin.config_set("maxmemory", 0)
    assert wait_until(lambda: _registered(admin, replicas), timeout=60)


def test_a_clean_shutdown_leaves_the_router_at_once(setup, admin: redis.Redis) -> None:
    replicas, router = setup
    leaving, staying = replicas
    assert wait_until(lambda: _registered(admin, replicas), timeout=60)
    leaving.proc.send_signal(signal.SIGTERM)
    assert wait_until(lambda: leaving.url not in replicas_view(router), timeout=60)
    assert admin.exists(departed_key(leaving.url)) and not admin.exists(replica_key(leaving.url))
    assert f"replica {leaving.url} left discovery (deregistered)" in router.log.read_text()
    assert _routable(router) == {staying.url}
    leaving.proc.wait(60)
