"""A replica whose engine sleeps (vLLM's sleep mode) gets no traffic while another is awake: its
/health says so, the router's probe reads it, and requests go to the awake replicas until it
wakes up. With every replica asleep the router still routes (a sleeping replica holds a request
until it wakes)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from router_harness import Cluster, replicas_view, wait_until

BODY = {"model": "llama", "prompt": "hi", "max_tokens": 2}


def _served(router_url: str, count: int) -> None:
    for _ in range(count):
        r = httpx.post(router_url + "/v1/completions", json=BODY, timeout=60)
        assert r.status_code == 200, r.text


def test_a_sleeping_replica_gets_no_traffic_while_another_is_awake(cluster: Cluster) -> None:
    a, b = cluster.replicas(2, "--enable-sleep-mode")
    router = cluster.router("--replica", a.url, "--replica", b.url, "--policy", "round_robin")
    assert wait_until(lambda: all(v["routable"] for v in replicas_view(router).values()))
    assert httpx.post(a.url + "/sleep?level=1", timeout=60).status_code == 200
    assert httpx.get(a.url + "/health").json()["sleeping"] is True
    assert wait_until(lambda: replicas_view(router)[a.url]["sleeping"])
    before = {url: v["total_requests"] for url, v in replicas_view(router).items()}
    _served(router.url, 4)
    after = {url: v["total_requests"] for url, v in replicas_view(router).items()}
    assert after[a.url] == before[a.url] and after[b.url] == before[b.url] + 4
    view = replicas_view(router)[a.url]
    assert view["routable"] and view["health"] == "healthy"  # asleep, not failed

    # Both asleep: requests still go out, and each is held until its replica wakes up.
    assert httpx.post(b.url + "/sleep?level=1", timeout=60).status_code == 200
    assert wait_until(lambda: all(v["sleeping"] for v in replicas_view(router).values()))
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, router.url + "/v1/completions", json=BODY, timeout=60)
        assert wait_until(lambda: sum(v["inflight"] for v in replicas_view(router).values()) == 1)
        time.sleep(0.5)
        assert not pending.done()  # held by the sleeping replica
        for replica in (a, b):
            assert httpx.post(replica.url + "/wake_up", timeout=60).status_code == 200
        assert pending.result().status_code == 200

    assert wait_until(lambda: not any(v["sleeping"] for v in replicas_view(router).values()))
    before = {url: v["total_requests"] for url, v in replicas_view(router).items()}
    _served(router.url, 4)
    after = {url: v["total_requests"] for url, v in replicas_view(router).items()}
    assert after[a.url] - before[a.url] == after[b.url] - before[b.url] == 2  # round robin again
