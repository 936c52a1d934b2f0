"""Replicas behind `--api-key`: the router's own reads of them (`/v1/models`, which route requests by
model) carry `--replica-api-key`, and what it relays carries that key in place of the client's, so a
router with a key of its own fronts replicas with another."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from router_harness import Cluster, replicas_view, wait_until

PROMPT = {"prompt": "hello", "max_tokens": 2}


@pytest.fixture(scope="module")
def keyed(cluster: Cluster) -> Iterator:
    (replica,) = cluster.replicas(1, "--api-key", "replica-key")
    yield replica


def test_router_reads_and_relays_with_the_replicas_key(cluster: Cluster, keyed) -> None:
    name = httpx.get(keyed.url + "/v1/models", headers={"Authorization": "Bearer replica-key"}).json()
    model = name["data"][0]["id"]
    open_router = cluster.router("--replica", keyed.url, "--replica-api-key", "replica-key")
    assert wait_until(lambda: replicas_view(open_router)[keyed.url]["models"] == [model], 60)
    listed = httpx.get(open_router.url + "/v1/models").json()["data"]
    assert [m["id"] for m in listed] == [model]
    ok = httpx.post(open_router.url + "/v1/completions", json={"model": model, **PROMPT}, timeout=60)
    assert ok.status_code == 200, ok.text
    # SageMaker's paths: /ping is the router's health, /invocations is relayed.
    assert httpx.post(open_router.url + "/ping").status_code == 200
    sagemaker = httpx.post(open_router.url + "/invocations", json={"model": model, **PROMPT}, timeout=60)
    assert sagemaker.status_code == 200 and sagemaker.json()["object"] == "text_completion"

    # A router with its own key: clients show the router's key, replicas get theirs.
    guarded = cluster.router(
        "--replica", keyed.url, "--api-key", "router-key", "--replica-api-key", "replica-key"
    )
    body = {"model": model, **PROMPT}
    mine = httpx.post(
        guarded.url + "/v1/completions", json=body, headers={"Authorization": "Bearer router-key"}, timeout=60
    )
    assert mine.status_code == 200, mine.text
    theirs = httpx.post(
        guarded.url + "/v1/completions",
        json=body,
        headers={"Authorization": "Bearer replica-key"},
        timeout=60,
    )
    assert theirs.status_code == 401
    # vLLM's render and tokens-in/tokens-out generate: guarded and relayed as the others.
    mine_key = {"Authorization": "Bearer router-key"}
    rendered = httpx.post(guarded.url + "/v1/completions/render", json=body, headers=mine_key, timeout=60)
    assert rendered.status_code == 200, rendered.text
    [generate] = rendered.json()
    generated = httpx.post(
        guarded.url + "/inference/v1/generate", json=generate, headers=mine_key, timeout=60
    )
    assert generated.status_code == 200, generated.text
    assert generated.json()["choices"][0]["token_ids"]
    for path, payload in (("/v1/completions/render", body), ("/inference/v1/generate", generate)):
        assert httpx.post(guarded.url + path, json=payload, timeout=60).status_code == 401
        assert httpx.post(keyed.url + path, json=payload, timeout=60).status_code == 401
    # Anthropic's SDKs send the key as x-api-key: the router takes it, and never passes it on.
    messages = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    anthropic_style = httpx.post(
        guarded.url + "/v1/messages", json=messages, headers={"x-api-key": "router-key"}, timeout=60
    )
    assert anthropic_style.status_code == 200, anthropic_style.text
    assert anthropic_style.json()["type"] == "message"
    # Anthropic's request-id (the SDK's _request_id) is the router's X-Request-Id, relayed or its own.
    assert anthropic_style.headers["request-id"] == anthropic_style.headers["x-request-id"]
    wrong = httpx.post(guarded.url + "/v1/messages", json=messages, headers={"x-api-key": "replica-key"})
    assert wrong.status_code == 401
    # The router's own refusal, in Anthropic's shape as the replicas' are on this route.
    assert wrong.json()["type"] == "error" and wrong.json()["error"]["type"] == "authentication_error"
    assert wrong.json()["request_id"] == wrong.headers["request-id"] == wrong.headers["x-request-id"]
    assert int(wrong.headers["content-length"]) == len(wrong.content)


def test_without_the_key_the_router_cannot_read_the_models(cluster: Cluster, keyed) -> None:
    plain = cluster.router("--replica", keyed.url)
    assert wait_until(lambda: replicas_view(plain)[keyed.url]["routable"], 60)
    assert replicas_view(plain)[keyed.url]["models"] == []
    # The client's own header still passes through to the replica.
    denied = httpx.post(plain.url + "/v1/completions", json=PROMPT, timeout=60)
    assert denied.status_code == 401
    allowed = httpx.post(
        plain.url + "/v1/completions",
        json=PROMPT,
        headers={"Authorization": "Bearer replica-key"},
        timeout=60,
    )
    assert allowed.status_code == 200, allowed.text
