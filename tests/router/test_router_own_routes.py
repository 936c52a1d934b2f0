"""The routes a router answers itself, as a client of a replica expects them: ``/health`` counting
every pool of a prefill/decode cluster (the prefill pool included), ``X-Request-Id`` echoed on the
router's own answers, and vLLM's ``/version``, ``/load``, ``/is_sleeping``, ``/openapi.json``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from router_harness import Cluster, Proc, replicas_view, wait_until
from scripted_replica import DONE, GATE, ScriptedReplica, text_chunk

from ferry import __version__
from router.pool import awake
from router.replica import Replica


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[ScriptedReplica], Proc]]:
    """A router over one prefill and two decode workers (scripted)."""
    workers = [ScriptedReplica() for _ in range(3)]
    for w in workers:
        w.script = [text_chunk("a", 7), GATE, text_chunk("b", 8, "length"), b"data: [DONE]\n\n", DONE]
    cluster = Cluster(Path("unused"), tmp_path_factory.mktemp("router"))
    router = cluster.router(
        "--prefill", workers[0].url, "--decode", workers[1].url, "--decode", workers[2].url,
        "--policy", "round_robin",
    )  # fmt: skip
    assert wait_until(lambda: all(v["routable"] for v in replicas_view(router).values()), 60)
    yield workers, router
    cluster.close()
    for w in workers:
        w.close()


def test_health_counts_every_pool(pd) -> None:
    workers, router = pd
    r = httpx.get(router.url + "/health")
    assert r.status_code == 200
    assert r.json()["replicas"] == {"total": 3, "routable": 3}
    assert r.json()["roles"] == {
        "prefill": {"total": 1, "routable": 1},
        "decode": {"total": 2, "routable": 2},
    }
    workers[0].hung = True  # the prefill worker stops answering: still served (local prefill)
    try:
        assert wait_until(
            lambda: httpx.get(router.url + "/health").json()["roles"]["prefill"]["routable"] == 0
        )
        r = httpx.get(router.url + "/health")
        assert r.status_code == 200 and r.json()["replicas"] == {"total": 3, "routable": 2}
    finally:
        workers[0].hung = False
        assert wait_until(lambda: httpx.get(router.url + "/health").json()["replicas"]["routable"] == 3)


def test_the_routers_own_answers_echo_the_request_id(pd) -> None:
    _, router = pd
    for path in ("/v1/models", "/v1/models/m", "/health", "/version", "/load", "/metrics", "/admin/replicas"):
        r = httpx.get(router.url + path, headers={"x-request-id": "abc-123"})
        assert r.status_code == 200, path
        assert r.headers.get_list("x-request-id") == ["abc-123"], path
    r = httpx.get(router.url + "/no/such/route")
    assert r.status_code == 404 and len(r.headers["x-request-id"]) == 32  # one of its own


def test_version_load_and_openapi(pd) -> None:
    workers, router = pd
    assert httpx.get(router.url + "/version").json() == {"version": __version__}
    assert httpx.get(router.url + "/load").json() == {"server_load": 0}
    body = {"model": "m", "prompt": "x", "stream": True, "max_tokens": 2}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=10) as r:
        lines = r.iter_lines()
        assert json.loads(next(lines)[6:])["choices"][0]["text"] == "a"
        assert httpx.get(router.url + "/load").json() == {"server_load": 1}  # held at the gate
        for w in workers:
            w.release()
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    assert wait_until(lambda: httpx.get(router.url + "/load").json() == {"server_load": 0}, 60)
    doc = httpx.get(router.url + "/openapi.json").json()
    assert doc["openapi"].startswith("3.") and doc["info"]["version"] == __version__
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    ref = chat["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    schema = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert {"messages", "model", "stream"} <= set(schema["properties"])
    assert {"/health", "/version", "/load", "/is_sleeping", "/admin/replicas"} <= set(doc["paths"])
    assert "post" in doc["paths"]["/inference/v1/generate"]


def test_is_sleeping_says_whether_every_healthy_replica_sleeps(pd) -> None:
    workers, router = pd
    r = httpx.get(router.url + "/is_sleeping")
    assert r.json() == {"is_sleeping": False, "replicas": dict.fromkeys((w.url for w in workers), False)}
    try:
        for w in workers[:2]:
            w.health_body = {"status": "ok", "sleeping": True}
        assert wait_until(
            lambda: sum(httpx.get(router.url + "/is_sleeping").json()["replicas"].values()) == 2
        )
        assert httpx.get(router.url + "/is_sleeping").json()["is_sleeping"] is False  # one is awake
        workers[2].health_body = {"status": "ok", "sleeping": True}
        assert wait_until(lambda: httpx.get(router.url + "/is_sleeping").json()["is_sleeping"] is True)
    finally:
        for w in workers:
            w.health_body = {"status": "ok"}


def test_a_paused_replica_is_kept_apart_like_a_sleeping_one(pd) -> None:
    """A replica whose generation is paused (vLLM's /pause: its /health says ``paused``) holds new
    requests until resumed: the probe reads it, and ``awake`` leaves it out while another is not."""
    workers, router = pd
    try:
        workers[1].health_body = {"status": "ok", "paused": True}
        assert wait_until(lambda: replicas_view(router)[workers[1].url]["paused"] is True)
        view = replicas_view(router)[workers[1].url]
        assert (view["sleeping"], view["routable"]) == (False, True)
        assert httpx.get(router.url + "/is_sleeping").json()["is_sleeping"] is False  # paused is not asleep
    finally:
        workers[1].health_body = {"status": "ok"}
    assert wait_until(lambda: replicas_view(router)[workers[1].url]["paused"] is False)
    a, b, c = (Replica(f"http://{n}") for n in "abc")
    b.paused = c.sleeping = True
    assert awake([a, b, c]) == [a]
    a.paused = True
    assert awake([a, b, c]) == [a, b, c]  # all held somewhere: better than no answer


def test_reset_prefix_cache_passes_its_query_to_every_replica(pd) -> None:
    """vLLM's ``reset_running_requests=true`` reaches every replica as sent (these scripted ones
    know no such route: their 404 is the answer, with each replica's status)."""
    workers, router = pd
    r = httpx.post(router.url + "/reset_prefix_cache?reset_running_requests=true")
    assert r.status_code == 404
    assert r.json() == {"replicas": dict.fromkeys((w.url for w in workers), 404)}
    for w in workers:
        assert ("POST", "/reset_prefix_cache?reset_running_requests=true") in w.requests
