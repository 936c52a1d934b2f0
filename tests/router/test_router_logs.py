"""What the router logs about failures its traffic finds: a replica ejected by a request's connect
error (before, only a later probe's "ejected -> healthy" said anything), the request re-sent with
its id, and the per-request lines kept to a rate a log can take (``router/log_limit.py``)."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
from router_harness import Cluster, metric, replicas_view, wait_until
from scripted_replica import ScriptedReplica

from router.log_limit import RateLimitedLog


def test_an_ejection_by_traffic_and_the_retry_are_logged(tmp_path: Path) -> None:
    dead, alive = ScriptedReplica(), ScriptedReplica()
    cluster = Cluster(tmp_path, tmp_path)
    try:
        # Probes at start only: what happens next is learnt from traffic.
        router = cluster.router(
            "--replica", dead.url, "--replica", alive.url, "--policy", "round_robin",
            "--health-interval", "60",
        )  # fmt: skip
        assert wait_until(lambda: all(v["routable"] for v in replicas_view(router).values()), 60)
        dead.stop_listening()
        body = {"model": "m", "prompt": "x", "max_tokens": 1}
        r = httpx.post(
            router.url + "/v1/completions", json=body, headers={"x-request-id": "rid-7"}, timeout=10
        )
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "whole"
        assert (len(dead.bodies), len(alive.bodies)) == (0, 1)
        log = router.log.read_text()
        assert f"replica {dead.url}: healthy -> ejected (connect error: " in log
        retried = f"request rid-7: {dead.url} unreachable ("
        assert any(
            retried in line and "; re-sent to another replica (retry 1 of 2)" in line
            for line in log.splitlines()
        )
        assert replicas_view(router)[dead.url]["health"] == "ejected"
        assert metric(router.url, "ferry:router_replica_healthy", {"replica": dead.url}) == 0
    finally:
        cluster.close()
        dead.close()
        alive.close()


def test_per_request_lines_are_rate_limited(caplog) -> None:
    now = [0.0]
    limited = RateLimitedLog(logging.getLogger("test.limit"), burst=2, window=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, "test.limit"):
        for i in range(5):
            limited.warning("retry %d", i)
        now[0] = 10.0
        limited.warning("retry %d", 5)
    assert [r.getMessage() for r in caplog.records] == [
        "retry 0",
        "retry 1",
        "retry 5 (3 similar lines left out)",
    ]
