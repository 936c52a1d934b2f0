"""A replica that joins a running router (admin API or discovery; or one that comes up after the
router did) takes no request before the router knows the models and LoRA adapters it serves: the
prober reads its ``/v1/models`` before marking it healthy, so a request for an adapter only it serves
never goes to a replica without it (which would answer a 404 for a model a healthy replica serves)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from router_harness import Cluster, replicas_view, wait_until
from scripted_replica import ScriptedReplica

ADAPTER = {"id": "x", "object": "model", "root": "/adapters/x", "parent": "m", "lora_preloaded": True}


@pytest.fixture(scope="module")
def replicas() -> Iterator[tuple[ScriptedReplica, ScriptedReplica]]:
    base, with_x = ScriptedReplica(), ScriptedReplica()
    with_x.models["data"].append(ADAPTER)  # served from --lora-modules: not spread to `base`
    yield base, with_x
    base.close()
    with_x.close()


def test_a_joining_replica_is_routable_only_once_its_adapters_are_known(
    replicas: tuple[ScriptedReplica, ScriptedReplica], tmp_path: Path
) -> None:
    base, with_x = replicas
    cluster = Cluster(tmp_path, tmp_path)
    try:
        router = cluster.router("--replica", base.url, "--policy", "round_robin", all_routable=True)
        with_x.models_delay = 1.0  # its list comes 1 s after its first good /health
        with ThreadPoolExecutor(1) as pool:  # the admin API answers once it probed the replica
            added = pool.submit(
                httpx.post, router.url + "/admin/replicas", json={"url": with_x.url}, timeout=10
            )
            assert wait_until(lambda: with_x.url in replicas_view(router), 10, interval=0.02)
            assert wait_until(lambda: replicas_view(router)[with_x.url]["routable"], 10, interval=0.02)
            seen = replicas_view(router)[with_x.url]["models"]
            answers = [_complete(router.url) for _ in range(4)]
            assert added.result().status_code == 201, added.result().text
        # Routable: the router knew what it serves, and sent the adapter's requests only there.
        assert [b["model"] for b in base.bodies] == []
        assert [b["model"] for b in with_x.bodies] == ["x"] * 4
        assert answers == [200] * 4
        assert seen == ["m", "x"]
    finally:
        cluster.close()


def _complete(url: str) -> int:
    body = {"model": "x", "prompt": "hi", "max_tokens": 1}
    return httpx.post(url + "/v1/completions", json=body, timeout=10).status_code
