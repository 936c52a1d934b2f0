"""A replica whose ``/health`` names another role than the one the router was given for it: one
reporting ``prefill`` (a prefill worker answers every request with one token) gets no whole
requests, and the router says why in its log and in ``/admin/replicas``; the internal
``kv_transfer`` result never reaches a client that did not send ``kv_transfer`` itself."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from router_harness import Cluster, replicas_view, wait_until
from scripted_replica import DONE, ScriptedReplica, data_event

KV_RESULT = {"block_hashes": [], "num_cached_tokens": 0, "tier_blocks": 0, "tier_write_complete": True}


def test_a_replica_reporting_prefill_gets_no_whole_requests(tmp_path: Path) -> None:
    prefill, mixed, added = ScriptedReplica(), ScriptedReplica(), ScriptedReplica()
    prefill.health_body = added.health_body = {"status": "ok", "role": "prefill"}
    mixed.health_body = {"status": "ok", "role": "mixed"}
    cluster = Cluster(tmp_path, tmp_path)
    try:
        router = cluster.router("--replica", prefill.url, "--replica", mixed.url, "--policy", "round_robin")
        assert wait_until(lambda: replicas_view(router)[mixed.url]["routable"], 60)
        view = replicas_view(router)[prefill.url]
        assert (view["role"], view["reported_role"], view["health"], view["routable"]) == (
            "mixed", "prefill", "healthy", False,
        )  # fmt: skip
        for _ in range(4):
            r = httpx.post(router.url + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=10)
            assert r.status_code == 200
        assert (len(prefill.bodies), len(mixed.bodies)) == (0, 4)
        assert f"replica {prefill.url} was added as a mixed replica (static) but reports role 'prefill'" in (
            router.log.read_text()
        )
        # Added at run time without a role (mixed by default): the answer says what it reports.
        r = httpx.post(router.url + "/admin/replicas", json={"url": added.url}, timeout=10)
        assert r.status_code == 201
        assert (r.json()["reported_role"], r.json()["routable"]) == ("prefill", False)
    finally:
        cluster.close()
        for r in (prefill, mixed, added):
            r.close()


def test_kv_transfer_never_reaches_a_client_that_did_not_send_it(tmp_path: Path) -> None:
    replica = ScriptedReplica()
    replica.whole = {"id": "w", "choices": [{"index": 0, "text": "a"}], "kv_transfer": KV_RESULT}
    chunk = {"id": "c", "choices": [{"index": 0, "text": "a", "token_ids": [7], "finish_reason": "length"}]}
    replica.script = [data_event({**chunk, "kv_transfer": KV_RESULT}), b"data: [DONE]\n\n", DONE]
    cluster = Cluster(tmp_path, tmp_path)
    try:
        router = cluster.router("--replica", replica.url)
        assert wait_until(lambda: replicas_view(router)[replica.url]["routable"], 60)
        body = {"model": "m", "prompt": "x", "max_tokens": 1}
        whole = httpx.post(router.url + "/v1/completions", json=body, timeout=10).json()
        assert whole == {"id": "w", "choices": [{"index": 0, "text": "a"}]}
        with httpx.stream("POST", router.url + "/v1/completions", json={**body, "stream": True}) as r:
            events = [line for line in r.iter_lines() if line]
        assert [json.loads(e[6:]) for e in events[:-1]] == [
            {"id": "c", "choices": [{"index": 0, "text": "a", "finish_reason": "length"}]}
        ]
        # One that asks for a hand-off itself (a router in front of this one) gets the result.
        producer = {**body, "kv_transfer": {"role": "producer"}}
        assert httpx.post(router.url + "/v1/completions", json=producer).json()["kv_transfer"] == KV_RESULT
    finally:
        cluster.close()
        replica.close()
