"""The router's own routes take the methods a replica's do: ``GET``/``HEAD`` on ``/health``,
``/metrics``, ``/version``, ``/load``, ``/is_sleeping``, ``/openapi.json`` (``/ping`` also ``POST``,
as SageMaker's), ``POST`` on ``/reset_prefix_cache``; any other method is the replica's 405 in
OpenAI's error shape, not a 200 (a ``POST /health`` is no health check) or a 404."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from router_harness import Cluster, Proc, replicas_view, wait_until
from scripted_replica import ScriptedReplica

METHOD_NOT_ALLOWED = {
    "error": {
        "message": "Method Not Allowed",
        "type": "MethodNotAllowedError",
        "param": None,
        "code": "method_not_allowed",
    }
}
READ_ONLY = ["/health", "/metrics", "/version", "/load", "/is_sleeping", "/openapi.json"]


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    replica = ScriptedReplica()
    cluster = Cluster(Path("unused"), tmp_path_factory.mktemp("router"))
    proc = cluster.router("--replica", replica.url)
    assert wait_until(lambda: all(v["routable"] for v in replicas_view(proc).values()), 60)
    yield proc
    cluster.close()
    replica.close()


@pytest.mark.parametrize("path", READ_ONLY)
@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "OPTIONS", "PATCH"])
def test_other_methods_on_read_only_routes_are_405(router: Proc, path: str, method: str) -> None:
    r = httpx.request(method, router.url + path, headers={"X-Request-Id": "m-1"})
    assert r.status_code == 405, r.text
    assert r.json() == METHOD_NOT_ALLOWED
    assert r.headers["allow"] == "GET, HEAD"
    assert r.headers["x-request-id"] == "m-1"


@pytest.mark.parametrize("path", READ_ONLY)
def test_get_and_head_still_answer(router: Proc, path: str) -> None:
    assert httpx.get(router.url + path).status_code == 200
    head = httpx.head(router.url + path)
    assert head.status_code == 200 and head.content == b""


def test_ping_takes_get_and_post_only(router: Proc) -> None:
    assert httpx.get(router.url + "/ping").status_code == 200
    assert httpx.post(router.url + "/ping").status_code == 200
    r = httpx.delete(router.url + "/ping")
    assert r.status_code == 405 and r.json() == METHOD_NOT_ALLOWED
    assert r.headers["allow"] == "GET, HEAD, POST"


@pytest.mark.parametrize("method", ["GET", "DELETE"])
def test_reset_prefix_cache_needs_post(router: Proc, method: str) -> None:
    r = httpx.request(method, router.url + "/reset_prefix_cache")
    assert r.status_code == 405 and r.json() == METHOD_NOT_ALLOWED
    assert r.headers["allow"] == "POST"


def test_cors_preflight_is_still_answered(router: Proc) -> None:
    preflight = {"Origin": "http://app.example", "Access-Control-Request-Method": "GET"}
    r = httpx.options(router.url + "/health", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
