"""``ferry:router_request_latency_seconds`` counts every request the router admitted, once, by how
it ended (``outcome``): ``ok`` (answered to the end), ``client_gone`` (the client left mid-stream),
``error`` (a stream its replica broke off that no replica could resume). Driven against a scripted
replica, so each stream stops exactly where the test needs; exact ``_count`` values, no timings.
"""

from __future__ import annotations

from pathlib import Path

import httpx
from router_harness import Cluster, metric, replicas_view, wait_until
from scripted_replica import DONE, GATE, ScriptedReplica, text_chunk

LATENCY = "ferry:router_request_latency_seconds_count"
DONE_EVENT = b"data: [DONE]\n\n"


def test_every_request_is_timed_once_by_how_it_ended(tmp_path: Path) -> None:
    replica = ScriptedReplica()
    cluster = Cluster(tmp_path, tmp_path)
    try:
        router = cluster.router("--replica", replica.url, "--circuit-failures", "100")
        assert wait_until(lambda: replicas_view(router)[replica.url]["routable"], 60)
        # Every outcome is exposed from the start, at 0.
        assert {o: metric(router.url, LATENCY, {"outcome": o}) for o in ("ok", "error", "client_gone")} == {
            "ok": 0,
            "error": 0,
            "client_gone": 0,
        }
        replica.scripts = [
            [text_chunk("a", 7), text_chunk("b", 8, "length"), DONE_EVENT, DONE],  # answered
            [text_chunk("a", 7), GATE, text_chunk("b", 8, "length"), DONE_EVENT, DONE],  # client leaves
            [text_chunk("a", 7)],  # the replica dies mid-stream: nobody can resume it
        ]
        body = {"model": "m", "prompt": "x", "max_tokens": 2, "stream": True}
        answered = httpx.post(router.url + "/v1/completions", json=body, timeout=20)
        assert answered.status_code == 200 and answered.text.endswith("data: [DONE]\n\n")

        with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=20) as r:
            assert r.status_code == 200
            next(line for line in r.iter_lines() if line.startswith("data: {"))
        # The client is gone while the replica still holds the rest of its answer.
        assert wait_until(lambda: metric(router.url, LATENCY, {"outcome": "client_gone"}) == 1, 60)
        replica.release()

        broken = httpx.post(router.url + "/v1/completions", json=body, timeout=20)
        assert broken.status_code == 200 and '"error"' in broken.text  # an error event ends it
        whole = httpx.post(router.url + "/v1/completions", json={**body, "stream": False}, timeout=20)
        assert whole.status_code == 200
        assert wait_until(lambda: metric(router.url, LATENCY) == 4, 60)
        assert {o: metric(router.url, LATENCY, {"outcome": o}) for o in ("ok", "error", "client_gone")} == {
            "ok": 2,
            "error": 1,
            "client_gone": 1,
        }
    finally:
        cluster.close()
        replica.close()
