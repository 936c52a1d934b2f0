"""The router remembers which replica holds a response only when one holds it: a ``POST
/v1/responses`` with ``"store": false`` leaves no entry in its response-id map (found by
``bench/soak.py``: every unstored response's id stayed there, ~400 bytes each up to the map's
bound of 100,000). Seen from outside through ``ferry:router_response_affinity_total``: a request
naming a remembered id is a ``hit``, one naming an id the router does not know a ``miss``."""

from __future__ import annotations

import httpx
import pytest
from router_harness import Cluster, Proc, metric

MODEL = "llama"
AFFINITY = "ferry:router_response_affinity_total"


@pytest.fixture(scope="module")
def router(cluster: Cluster) -> Proc:
    (replica,) = cluster.replicas(1)
    return cluster.router("--replica", replica.url)


def _outcomes(router: Proc) -> tuple[float, float]:
    return (
        metric(router.url, AFFINITY, {"outcome": "hit"}),
        metric(router.url, AFFINITY, {"outcome": "miss"}),
    )


def _create(router: Proc, **extra: object) -> str:
    body = {"model": MODEL, "input": "Hello", "max_output_tokens": 2, "temperature": 0.0, **extra}
    answer = httpx.post(router.url + "/v1/responses", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()["id"]


def test_an_unstored_response_is_not_remembered(router: Proc) -> None:
    unstored = _create(router, store=False)
    hits, misses = _outcomes(router)
    answer = httpx.get(f"{router.url}/v1/responses/{unstored}", timeout=30)
    assert answer.status_code == 404  # the replica never held it
    assert _outcomes(router) == (hits, misses + 1)  # and the router did not remember it


def test_a_stored_response_is_remembered(router: Proc) -> None:
    for stored in (_create(router), _create(router, store=True)):  # store defaults to true
        hits, misses = _outcomes(router)
        answer = httpx.get(f"{router.url}/v1/responses/{stored}", timeout=30)
        assert answer.status_code == 200 and answer.json()["id"] == stored
        assert _outcomes(router) == (hits + 1, misses)
