"""The router's ``/v1/models`` when replicas do not answer it in time: it answers from the lists its
prober last read from them (what a client would have seen a moment ago), and when it knows no list
at all, 503 with ``Retry-After`` (a server-side condition) — never a 200 with an empty list, nor a
404 ``model_not_found`` that would tell a client the model is gone."""

from __future__ import annotations

from pathlib import Path

import httpx
from router_harness import Cluster, replicas_view, wait_until
from scripted_replica import ScriptedReplica


def test_models_answered_from_what_the_router_knows_else_503(tmp_path: Path) -> None:
    known, unknown = ScriptedReplica(models=("m", "lora-a")), ScriptedReplica()
    unknown.models_hang = True  # never answers /v1/models: the router never read its list
    cluster = Cluster(tmp_path, tmp_path)
    try:
        router = cluster.router(
            "--replica", known.url, "--replica", unknown.url, "--policy", "round_robin",
            "--health-timeout", "0.5",
        )  # fmt: skip
        assert wait_until(lambda: all(v["routable"] for v in replicas_view(router).values()), 60)
        assert wait_until(lambda: replicas_view(router)[known.url]["models"] == ["m", "lora-a"], 60)
        known.models_hang = True  # now neither answers /v1/models

        listed = httpx.get(router.url + "/v1/models", timeout=10)
        assert listed.status_code == 200
        assert [m["id"] for m in listed.json()["data"]] == ["m", "lora-a"]
        assert httpx.get(router.url + "/v1/models/lora-a", timeout=10).json()["id"] == "lora-a"
        # Not in what the router knows, but a replica it knows nothing of might serve it.
        missing = httpx.get(router.url + "/v1/models/other", timeout=10)
        assert missing.status_code == 503 and missing.headers["retry-after"] == "1"

        # Only the replica whose list the router never read: nothing to answer from.
        httpx.request("DELETE", router.url + "/admin/replicas", json={"url": known.url}).raise_for_status()
        for path in ("/v1/models", "/v1/models/m"):
            r = httpx.get(router.url + path, timeout=10)
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            error = r.json()["error"]
            assert error["type"] == "ServiceUnavailableError"
            assert "no replica answered /v1/models in time" in error["message"]
        unknown.models_hang = False  # answering: every replica represented, so a true 404
        assert httpx.get(router.url + "/v1/models/other", timeout=10).status_code == 404
    finally:
        cluster.close()
        known.close()
        unknown.close()
