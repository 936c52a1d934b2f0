"""The PD router's 503 when its prefill pool is down too: the answer and the fallback label name
both pools, not the decode pool alone.

A real ``ferry router`` over a prefill and a decode worker that do not exist (nothing listens on
their ports), and the router's own decision over its pools in-process.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from router.app import RouterApp
from router.config import RouterConfig
from router.pd_config import PDConfig
from router.policies.base import RouteRequest
from router.relay import ProxyCall
from tests.router.router_harness import Cluster, Proc, free_port, metric

CHAT = "/v1/chat/completions"
BODY = {"messages": [{"role": "user", "content": "def f(x):\n    return"}], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def dead_pd(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    cluster = Cluster(tiny_llama, tmp_path_factory.mktemp("pd-unavailable"))
    try:
        dead = [f"http://127.0.0.1:{free_port()}" for _ in range(3)]
        yield cluster.router(
            "--model", str(tiny_llama), "--pd-threshold", "0",
            "--prefill", dead[0], "--prefill", dead[1], "--decode", dead[2],
        )  # fmt: skip
    finally:
        cluster.close()


@pytest.mark.parametrize("stream", [False, True])
def test_503_names_the_prefill_pool_when_it_is_down_too(dead_pd: Proc, stream: bool) -> None:
    before = metric(dead_pd.url, "ferry:router_pd_local_prefill_total", {"reason": "no_worker"})
    r = httpx.post(dead_pd.url + CHAT, json={**BODY, "stream": stream}, timeout=30)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json() == {
        "error": {
            "message": "no healthy replica available "
            "(prefill pool: 2 registered, decode pool: 1 registered; none routable now)",
            "type": "ServiceUnavailableError",
            "param": None,
            "code": "service_unavailable",
        }
    }
    assert r.headers["x-request-id"]
    after = metric(dead_pd.url, "ferry:router_pd_local_prefill_total", {"reason": "no_worker"})
    assert after == before + 1
    # Not blamed on the prefill pool alone, and not counted as served by a decode worker.
    assert metric(dead_pd.url, "ferry:router_pd_local_prefill_total", {"reason": "no_prefill_worker"}) == 0
    assert metric(dead_pd.url, "ferry:router_pd_requests_total", {"path": "local_prefill"}) == 0


def test_local_reason_tells_which_pool_is_down(tiny_llama: Path) -> None:
    app = RouterApp(
        RouterConfig(
            prefill=("http://127.0.0.1:7001",), decode=("http://127.0.0.1:7101",), model=str(tiny_llama)
        ),
        pd=PDConfig(pd_threshold=8),
    )
    for r in app.replicas:
        r.on_probe_ok(0.0)
    pools = app.replicas.pools
    (prefill,), (decode,) = pools["prefill"], pools["decode"]

    def reason() -> str | None:
        call = ProxyCall("POST", "/v1/completions", b"", [], b"", "rid", RouteRequest("rid"),
                         {"prompt": list(range(10, 80)), "max_tokens": 4})  # fmt: skip
        return asyncio.run(app.pd._local_reason(call, pools["prefill"], pools["decode"]))

    assert reason() is None
    decode.draining = True
    assert reason() == "no_decode_worker"
    prefill.draining = True
    assert reason() == "no_worker"
    decode.draining = False
    assert reason() == "no_prefill_worker"
