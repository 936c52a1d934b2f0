"""A request for a model whose replicas are all down is the router's 503 (retry later), never
another model's replica answering that the model does not exist.

Two replicas of the tiny model under different names (``alpha``, ``beta``) behind one router;
``alpha``'s replica is then killed. ``alpha`` must get 503 with ``Retry-After`` (vLLM's and
SGLang's routers answer 503 when no worker of a model is available), ``beta`` its answer, and a
name no replica ever listed still the replicas' own 404.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.router.router_harness import Cluster, Proc, replicas_view, wait_until


@pytest.fixture(scope="module")
def two_models(
    tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Proc, Proc, Proc]]:
    cluster = Cluster(tiny_llama, tmp_path_factory.mktemp("model-down"))
    try:
        (alpha,) = cluster.replicas(1, "--served-model-name", "alpha")
        (beta,) = cluster.replicas(1, "--served-model-name", "beta")
        router = cluster.router("--replica", alpha.url, "--replica", beta.url, "--policy", "round_robin")
        assert wait_until(lambda: all(r["models"] for r in replicas_view(router).values()))
        yield alpha, beta, router
    finally:
        cluster.close()


def _complete(router: Proc, model: str, **fields) -> httpx.Response:
    body = {"model": model, "prompt": "hello there", "max_tokens": 2, **fields}
    return httpx.post(router.url + "/v1/completions", json=body, timeout=30)


def test_a_model_whose_replicas_are_down_gets_503(two_models: tuple[Proc, Proc, Proc]) -> None:
    alpha, beta, router = two_models
    for _ in range(2):  # round robin: each name reaches its own replica whatever the turn
        assert _complete(router, "alpha").json()["model"] == "alpha"
        assert _complete(router, "beta").json()["model"] == "beta"
    alpha.kill9()
    assert wait_until(lambda: not replicas_view(router)[alpha.url]["routable"])
    for stream in (False, True):
        r = _complete(router, "alpha", stream=stream)
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "1"
        error = r.json()["error"]
        assert "alpha" in error["message"] and error["code"] == "service_unavailable"
    assert _complete(router, "beta").status_code == 200
    missing = _complete(router, "gamma")  # listed by no replica: the replica's own answer
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
