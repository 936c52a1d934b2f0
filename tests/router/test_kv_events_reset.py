"""A prefix-cache reset on a replica whose KV events the router follows: the router's index agrees
with the replica's real cache afterwards, whichever the router reads first, the events around the
reset or the reset itself (its ``/health``'s ``prefix_cache_resets``, or its own fan-out).

A real replica (``--kv-events`` on a real Redis stream), the router's real ``RouterApp`` in-process
so that the test decides when its health probe and its event follower run: the orders that race
in a live router are each played out exactly. What the replica really holds is read from its
answers' ``cached_tokens``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx
import redis
from router_harness import Cluster, metric

from kvcache.events import KVEventReader
from kvcache.keys import block_hashes
from router.app import RouterApp
from router.config import RouterConfig
from router.kv_events import STREAM_PATTERN

BLOCK = 16
P0 = [(3 * i + 7) % 900 + 10 for i in range(40)]  # token ids: 2 full blocks each
P1 = [(5 * i + 11) % 900 + 10 for i in range(40)]
P2 = [(7 * i + 13) % 900 + 10 for i in range(40)]


def _cached(url: str, prompt: list[int]) -> int:
    """Prompt tokens the replica found in its own (device) prefix cache for one request of
    ``prompt``: its answer's cached tokens less those it loaded from the KV tier."""
    tier_hits = metric(url, "ferry:kv_tier_hits_total")
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=60)
    assert r.status_code == 200, r.text
    loaded = (metric(url, "ferry:kv_tier_hits_total") - tier_hits) * BLOCK
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] - int(loaded)


def _device_events(redis_url: str) -> int:
    streams = [k.decode() for k in redis.Redis.from_url(redis_url).scan_iter(match=STREAM_PATTERN)]
    total = 0
    for name in streams:
        reader = KVEventReader(redis_url, name.rsplit(":", 1)[1])
        total += sum(e.medium == "device" for e in reader.read(count=10_000))
        reader.close()
    return total


def _until(check: Callable[[], bool], timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False


def test_index_agrees_with_the_replica_after_resets_whatever_the_router_reads_first(
    cluster: Cluster, private_redis
) -> None:
    tier = private_redis().url
    (replica,) = cluster.replicas(1, "--kv-tier", tier, "--kv-events", "--num-kv-blocks", "64")
    url = replica.url

    async def scenario() -> None:
        app = RouterApp(
            RouterConfig(replicas=(url,), policy="cache_aware", model=str(cluster.model), kv_tier=tier)
        )
        follower = app.kv_events
        assert follower is not None
        index = app.policy.index  # type: ignore[attr-defined]
        (r,) = app.replicas

        def held(prompt: list[int]) -> int:
            return index.match(block_hashes(prompt, BLOCK), [url])[url] * BLOCK

        def caught_up() -> bool:
            """Every device event on the stream is applied (one instance: none stale or held)."""
            follower.poll_once()
            return follower.applied == _device_events(tier)

        try:
            assert await app.health.probe(r)
            resets = r.prefix_cache_resets
            assert isinstance(resets, int) and r.instance_id is not None

            # 1. The reset is seen by the probe only after the events of blocks cached since.
            assert _cached(url, P0) == 0
            assert _until(caught_up) and held(P0) == 32
            assert httpx.post(url + "/reset_prefix_cache", timeout=10).status_code == 200
            assert _cached(url, P2) == 0  # stored after the reset
            assert _until(caught_up) and (held(P0), held(P2)) == (0, 32)
            assert await app.health.probe(r)
            assert r.prefix_cache_resets == resets + 1  # the probe saw the reset now ...
            assert (held(P0), held(P2)) == (0, 32)  # ... and keeps the blocks cached after it

            # 2. The router's own fan-out, with the replica's last stored events not read yet
            # (they race with the reset): read after it, they are undone by the reset's removals.
            assert _cached(url, P1) == 0
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
                fanned = await client.post("/reset_prefix_cache")
            assert fanned.status_code == 200, fanned.text
            assert _until(caught_up)
            assert (held(P0), held(P1), held(P2)) == (0, 0, 0)
            assert await app.health.probe(r)
            assert (held(P0), held(P1), held(P2)) == (0, 0, 0)
            index.check_integrity()

            # What the index says is what the replica holds.
            assert (_cached(url, P1), _cached(url, P2)) == (0, 0)
            assert _until(caught_up) and (held(P1), held(P2)) == (32, 32)
            assert _cached(url, P2) == 32
        finally:
            await app.client.aclose()
            await app.upstream.aclose()

    asyncio.run(scenario())
