"""A replica that stops serving a LoRA adapter between two reads of its ``/v1/models`` (it restarted
without an adapter loaded at run time, or another router or a client unloaded it there) answers the
router's request for it with a 404 ``model_not_found``: the router takes the adapter off that
replica's list at once, reads the list again at its next probe, and re-sends the request to a
replica that lists the adapter, instead of relaying a 404 for a model a healthy replica serves."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from router_harness import Cluster, Proc, replicas_view, wait_until

from engine.demo import build_lora_adapter


@pytest.fixture(scope="module")
def setup(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Iterator[tuple]:
    adapter = build_lora_adapter(tmp_path_factory.mktemp("lora") / "x", tiny_llama, seed=3, alpha=32)
    replicas = cluster.replicas(2, "--enable-lora", "--allow-runtime-lora-updating")
    args = [a for r in replicas for a in ("--replica", r.url)]
    router = cluster.router(*args, "--policy", "round_robin", all_routable=True)
    yield replicas, router, adapter


def _complete(router: Proc) -> int:
    body = {"model": "x", "prompt": "hello", "max_tokens": 2}
    return httpx.post(router.url + "/v1/completions", json=body, timeout=60).status_code


def test_a_404_from_a_replica_whose_list_is_stale_is_sent_elsewhere(setup: tuple) -> None:
    (keeps, loses), router, adapter = setup
    load = {"lora_name": "x", "lora_path": str(adapter)}
    assert httpx.post(router.url + "/v1/load_lora_adapter", json=load, timeout=60).status_code == 200
    assert wait_until(lambda: all("x" in r["models"] for r in replicas_view(router).values()), 30)
    # Unloaded straight from one replica: the router still believes it serves "x" until it reads
    # that replica's list again (every few seconds).
    gone = httpx.post(loses.url + "/v1/unload_lora_adapter", json={"lora_name": "x"}, timeout=30)
    assert gone.status_code == 200
    assert [_complete(router) for _ in range(4)] == [200] * 4
    assert "x" not in replicas_view(router)[loses.url]["models"]
    assert "x" in replicas_view(router)[keeps.url]["models"]
