"""LoRA adapters loaded and unloaded through `ferry router` (router/lora_admin.py): the runtime routes
reach every replica, a replica's refusal comes back as its own error, and the router loads what it
remembers onto a replica that joins or restarts, so every replica serves the adapter."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from router_harness import Cluster, Proc, metric, replica_args, replicas_view, wait_until

from engine.demo import build_lora_adapter

LORA_FLAGS = ("--enable-lora", "--allow-runtime-lora-updating")
NAME = "fan"


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, tiny_llama: Path) -> Path:
    return build_lora_adapter(tmp_path_factory.mktemp("lora") / "fan", tiny_llama, seed=3, alpha=32)


@pytest.fixture(scope="module")
def setup(cluster: Cluster) -> Iterator[tuple[list[Proc], Proc]]:
    replicas = cluster.replicas(2, *LORA_FLAGS)
    router = cluster.router(*(a for r in replicas for a in ("--replica", r.url)), "--policy", "round_robin")
    assert wait_until(lambda: all(r["routable"] for r in replicas_view(router).values()), 30)
    yield replicas, router


def _listed(replica: Proc) -> list[str]:
    return [m["id"] for m in httpx.get(replica.url + "/v1/models", timeout=5).json()["data"]]


def _served(router: Proc, replica: Proc) -> float:
    return metric(router.url, "ferry:router_requests_total", {"replica": replica.url})


def _send(router: Proc, n: int) -> None:
    for _ in range(n):
        r = httpx.post(
            router.url + "/v1/completions",
            json={"model": NAME, "prompt": "hello", "max_tokens": 2},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.json()["model"] == NAME


def _routed_everywhere(router: Proc, replicas: list[Proc]) -> bool:
    view = replicas_view(router)
    return all(view[r.url]["routable"] and NAME in view[r.url]["models"] for r in replicas)


def _spread(router: Proc, replicas: list[Proc], per_replica: int) -> dict[str, float]:
    """Requests for the adapter, round robin: how many each replica served."""
    assert wait_until(lambda: _routed_everywhere(router, replicas), 30)
    before = {r.url: _served(router, r) for r in replicas}
    _send(router, per_replica * len(replicas))
    return {r.url: _served(router, r) - before[r.url] for r in replicas}


def test_a_malformed_body_is_refused_before_any_replica_sees_it(setup) -> None:
    _, router = setup
    for path, body, param in (
        ("/v1/load_lora_adapter", {"lora_path": "/x"}, "lora_name"),
        ("/v1/load_lora_adapter", {"lora_name": NAME, "lora_path": ""}, "lora_path"),
        ("/v1/load_lora_adapter", {"lora_name": 7, "lora_path": "/x"}, "lora_name"),
        ("/v1/unload_lora_adapter", {"lora_name": ""}, "lora_name"),
    ):
        r = httpx.post(router.url + path, json=body, headers={"x-request-id": "edge-1"}, timeout=10)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
        assert "replicas" not in r.json()  # answered by the router: no replica was asked
        assert r.headers["x-request-id"] == "edge-1"
    r = httpx.post(router.url + "/v1/load_lora_adapter", content=b"[1]", timeout=10)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "request body must be a JSON object"
    r = httpx.post(router.url + "/v1/unload_lora_adapter", content=b"{not json", timeout=10)
    assert r.status_code == 400


def test_a_bad_path_is_the_replicas_own_404(setup, tmp_path: Path) -> None:
    replicas, router = setup
    load = {"lora_name": "nowhere", "lora_path": str(tmp_path / "missing")}
    direct = httpx.post(replicas[0].url + "/v1/load_lora_adapter", json=load, timeout=30)
    assert direct.status_code == 404  # vLLM's: no adapter there
    r = httpx.post(router.url + "/v1/load_lora_adapter", json=load, timeout=30)
    assert r.status_code == 404, r.text
    assert r.json()["error"] == direct.json()["error"]
    assert r.json()["replicas"] == {p.url: 404 for p in replicas}
    assert all("nowhere" not in _listed(p) for p in replicas)
    assert metric(router.url, "ferry:router_lora_failures_total", {"op": "load"}) == 2


def test_a_load_through_the_router_reaches_every_replica(setup, adapter: Path) -> None:
    replicas, router = setup
    load = {"lora_name": NAME, "lora_path": str(adapter)}
    r = httpx.post(router.url + "/v1/load_lora_adapter", json=load, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json() == {
        "message": f"Success: LoRA adapter '{NAME}' added successfully.",
        "replicas": {p.url: 200 for p in replicas},
    }
    assert all(NAME in _listed(p) for p in replicas)
    assert _spread(router, replicas, 2) == {p.url: 2 for p in replicas}
    # Loaded again: each replica's own refusal, the first one's error in front.
    again = httpx.post(router.url + "/v1/load_lora_adapter", json=load, timeout=60)
    assert again.status_code == 400
    assert "already been loaded" in again.json()["error"]["message"]
    assert again.json()["replicas"] == {p.url: 400 for p in replicas}


def test_a_restarted_replica_gets_the_adapter_back(setup, cluster: Cluster) -> None:
    replicas, router = setup
    old = replicas[1]
    assert NAME in _listed(old)  # loaded through the router (the test before)
    first = httpx.get(old.url + "/health").json()["instance_id"]
    old.stop()
    restarted = Proc(replica_args(cluster.model, old.port, *LORA_FLAGS), old.port, old.log).start()
    cluster.procs.append(restarted)
    restarted.wait_http()
    assert httpx.get(restarted.url + "/health").json()["instance_id"] != first
    # A new process serves no runtime adapter of its own: the router loads it when it sees the restart.
    assert wait_until(lambda: NAME in _listed(restarted), 30)
    replicas[1] = restarted
    assert _spread(router, replicas, 2) == {p.url: 2 for p in replicas}
    assert metric(router.url, "ferry:router_lora_failures_total", {"op": "restore"}) == 0


def test_a_replica_added_later_gets_the_adapter(setup, cluster: Cluster) -> None:
    replicas, router = setup
    (late,) = cluster.replicas(1, *LORA_FLAGS)
    assert NAME not in _listed(late)
    r = httpx.post(router.url + "/admin/replicas", json={"url": late.url}, timeout=10)
    assert r.status_code in (200, 201), r.text
    assert wait_until(lambda: NAME in _listed(late), 30)
    everyone = [*replicas, late]
    assert _spread(router, everyone, 1) == {p.url: 1 for p in everyone}
    gone = httpx.request("DELETE", router.url + "/admin/replicas", json={"url": late.url}, timeout=10)
    assert gone.status_code == 200, gone.text
    late.stop()


def test_an_unload_through_the_router_reaches_every_replica(setup) -> None:
    replicas, router = setup
    r = httpx.post(router.url + "/v1/unload_lora_adapter", json={"lora_name": NAME}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["replicas"] == {p.url: 200 for p in replicas}
    assert all(NAME not in _listed(p) for p in replicas)
    gone = httpx.post(router.url + "/v1/unload_lora_adapter", json={"lora_name": NAME}, timeout=60)
    assert gone.status_code == 404
    assert gone.json()["error"]["message"] == f"The lora adapter '{NAME}' cannot be found."


def test_keys_and_every_pool(cluster: Cluster, adapter: Path) -> None:
    """Behind keys: the client shows the router's, every replica gets the replicas' (the restore's
    reads and loads too); a prefill worker gets the adapter as a mixed replica does."""
    flags = (*LORA_FLAGS, "--api-key", "replica-key")
    (mixed,) = cluster.replicas(1, *flags)
    router = cluster.router(
        "--replica", mixed.url, "--api-key", "router-key", "--replica-api-key", "replica-key"
    )
    mine = {"Authorization": "Bearer router-key"}
    load = {"lora_name": "keyed", "lora_path": str(adapter)}
    refused = httpx.post(router.url + "/v1/load_lora_adapter", json=load, timeout=60)
    assert refused.status_code == 401
    r = httpx.post(router.url + "/v1/load_lora_adapter", json=load, headers=mine, timeout=60)
    assert r.status_code == 200, r.text
    (prefill,) = cluster.replicas(1, *flags)
    added = httpx.post(
        router.url + "/admin/replicas", json={"url": prefill.url, "role": "prefill"}, headers=mine, timeout=10
    )
    assert added.status_code == 201, added.text
    theirs = {"Authorization": "Bearer replica-key"}

    def listed(p: Proc) -> list[str]:
        return [m["id"] for m in httpx.get(p.url + "/v1/models", headers=theirs).json()["data"]]

    assert wait_until(lambda: "keyed" in listed(prefill), 30)
    gone = httpx.post(
        router.url + "/v1/unload_lora_adapter", json={"lora_name": "keyed"}, headers=mine, timeout=60
    )
    assert gone.status_code == 200, gone.text
    assert gone.json()["replicas"] == {mixed.url: 200, prefill.url: 200}
    assert "keyed" not in listed(mixed) and "keyed" not in listed(prefill)
