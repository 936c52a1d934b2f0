"""vLLM's ``POST /pooling`` through a real router over loopback: relayed to the replica (one of the
routes ``FORWARD_ROOT_PATHS`` relays as they come), behind the router's API key and the replica's,
answering exactly what the replica answers directly; a replica's 400 comes back as it is."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from router_harness import Cluster, Proc, wait_until

KEY = {"Authorization": "Bearer k"}
BODY = {"input": ["def parse_args(argv):", "x = 1"]}


@pytest.fixture(scope="module")
def pair(cluster: Cluster) -> Iterator[tuple[Proc, Proc]]:
    (replica,) = cluster.replicas(1, "--api-key", "k")
    router = cluster.router("--replica", replica.url, "--api-key", "k")
    assert wait_until(lambda: httpx.get(router.url + "/health").status_code == 200, 30)
    yield replica, router


def test_pooling_is_relayed_behind_both_keys(pair) -> None:
    replica, router = pair
    for proc in (replica, router):
        denied = httpx.post(proc.url + "/pooling", json=BODY, timeout=60)
        assert denied.status_code == 401, denied.text
    direct = httpx.post(replica.url + "/pooling", json=BODY, headers=KEY, timeout=60)
    assert direct.status_code == 200, direct.text
    relayed = httpx.post(
        router.url + "/pooling", json=BODY, headers={**KEY, "X-Request-Id": "rp-7"}, timeout=60
    )
    assert relayed.status_code == 200, relayed.text
    body = relayed.json()
    assert body["id"] == "pool-rp-7" and body["object"] == "list"
    assert body["data"] == direct.json()["data"] and len(body["data"]) == 2
    assert all(len(d["data"]) == 64 for d in body["data"])
    assert body["usage"] == direct.json()["usage"] and body["usage"]["prompt_tokens"] > 0
    bad = httpx.post(router.url + "/pooling", json={**BODY, "dimensions": 8}, headers=KEY, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "dimensions"
    assert "/pooling" in httpx.get(router.url + "/openapi.json", timeout=10).json()["paths"]
