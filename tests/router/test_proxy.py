"""The router in front of real `ferry serve` replicas: OpenAI SDK parity, distribution, limits,
admin API, zero replicas, client disconnects, overload (all over loopback)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from body_strategies import BODIES, RELAY_FIELDS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from router_harness import Cluster, Proc, metric, replicas_view, wait_until

from tests.server.conftest import first_events, wait_in_progress

MODEL = "llama"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def pair(cluster: Cluster) -> list[Proc]:
    return cluster.replicas(2)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)


def _strip_ids(obj: dict) -> dict:
    """Without per-request ids, timestamps and the prefix-cache count (the direct call warmed the cache)."""
    out = {k: v for k, v in obj.items() if k not in ("id", "created")}
    if isinstance(out.get("usage"), dict):
        out["usage"] = {k: v for k, v in out["usage"].items() if k != "prompt_tokens_details"}
    return out


def _stream_view(chunks) -> dict:
    """What a client sees of a stream. Chunk boundaries are not compared: a replica batches the
    tokens decoded since its last send into one chunk, so they vary between two direct calls too."""
    text, finish, usage, meta, roles = [], [], None, set(), []
    for c in chunks:
        meta.add((c.object, c.model))
        if c.usage is not None:
            usage = _strip_ids({"usage": c.usage.model_dump()})["usage"]
        for ch in c.choices:
            delta = getattr(ch, "delta", None)
            if delta is not None:
                text.append(delta.content or "")
                if delta.role:
                    roles.append(delta.role)
            else:
                text.append(ch.text)
            if ch.finish_reason:
                finish.append(ch.finish_reason)
    return {"text": "".join(text), "finish": finish, "usage": usage, "meta": meta, "roles": roles}


def test_openai_sdk_through_router_is_identical_to_direct(cluster: Cluster, pair: list[Proc]) -> None:
    a, _ = pair
    router = cluster.router("--replica", a.url, "--policy", "round_robin")
    direct, routed = client(a.url), client(router.url)
    msgs = [{"role": "user", "content": "Tell me about routers."}]
    for kw in ({"temperature": 0}, {"temperature": 0.9, "seed": 7}):
        d = direct.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, **kw)
        r = routed.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, **kw)
        assert _strip_ids(r.model_dump()) == _strip_ids(d.model_dump())
        d = direct.completions.create(model=MODEL, prompt="def main():", max_tokens=12, **kw)
        r = routed.completions.create(model=MODEL, prompt="def main():", max_tokens=12, **kw)
        assert _strip_ids(r.model_dump()) == _strip_ids(d.model_dump())
        opts = {"stream": True, "stream_options": {"include_usage": True}}
        d = _stream_view(
            direct.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, **opts, **kw)
        )
        r = _stream_view(
            routed.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, **opts, **kw)
        )
        assert r == d and len(r["text"]) > 3
        d = _stream_view(
            direct.completions.create(model=MODEL, prompt="import os", max_tokens=12, **opts, **kw)
        )
        r = _stream_view(
            routed.completions.create(model=MODEL, prompt="import os", max_tokens=12, **opts, **kw)
        )
        assert r == d and len(r["text"]) > 3
    # n > 1 (never resumed, so passed through as sent): same choices, streamed or not.
    kw = {"max_tokens": 8, "n": 2, "seed": 3, "temperature": 0.9}
    d = direct.completions.create(model=MODEL, prompt="x = ", **kw)
    r = routed.completions.create(model=MODEL, prompt="x = ", **kw)
    assert _strip_ids(r.model_dump()) == _strip_ids(d.model_dump())

    def by_index(stream) -> dict[int, str]:
        out: dict[int, str] = {}
        for c in stream:
            for ch in c.choices:
                out[ch.index] = out.get(ch.index, "") + ch.text
        return out

    d = by_index(direct.completions.create(model=MODEL, prompt="y = ", stream=True, **kw))
    r = by_index(routed.completions.create(model=MODEL, prompt="y = ", stream=True, **kw))
    assert r == d and sorted(r) == [0, 1]
    models = routed.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_round_robin_exact_distribution_and_request_id(cluster: Cluster, pair: list[Proc]) -> None:
    a, b = pair
    router = cluster.router("--replica", a.url, "--replica", b.url, "--policy", "round_robin")
    for i in range(6):
        resp = httpx.post(
            router.url + "/v1/completions",
            headers={"X-Request-Id": f"rid-{i}"},
            json={"model": MODEL, "prompt": "x", "max_tokens": 1},
            timeout=30,
        )
        assert resp.status_code == 200 and resp.headers["x-request-id"] == f"rid-{i}"
    view = replicas_view(router)
    assert view[a.url]["total_requests"] == 3 and view[b.url]["total_requests"] == 3
    assert metric(router.url, "ferry:router_requests_total", {"replica": a.url, "status": "200"}) == 3
    resp = httpx.post(router.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1})
    assert len(resp.headers["x-request-id"]) == 32  # generated when absent
    # One a replica could not take is replaced, as a replica would: the replica and the client get
    # the router's, and the answer is named after it.
    bad = {"X-Request-Id": "not an id!"}
    resp = httpx.post(
        router.url + "/v1/completions", headers=bad, json={"model": MODEL, "prompt": "x", "max_tokens": 1}
    )
    assert (
        len(resp.headers["x-request-id"]) == 32
        and resp.json()["id"] == "cmpl-" + resp.headers["x-request-id"]
    )
    tok = httpx.post(router.url + "/tokenize", json={"model": MODEL, "prompt": "hello"}).json()
    assert tok == httpx.post(a.url + "/tokenize", json={"model": MODEL, "prompt": "hello"}).json()
    # vLLM's render (a /v1/* route) and tokens-in/tokens-out generate (a root route) are relayed.
    rendered = httpx.post(
        router.url + "/v1/chat/completions/render",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "temperature": 0,
        },
    )
    assert rendered.status_code == 200, rendered.text
    direct = httpx.post(a.url + "/inference/v1/generate", json=rendered.json(), timeout=30).json()
    routed = httpx.post(router.url + "/inference/v1/generate", json=rendered.json(), timeout=30)
    assert routed.status_code == 200, routed.text
    assert routed.json()["choices"] == direct["choices"]
    # With no X-Request-Id, the body's request_id names the answer through the router as it does
    # direct (vLLM's rule), whole and streamed; a client's X-Request-Id still wins.
    named = "generate-tokens-" + rendered.json()["request_id"]
    assert routed.json()["id"] == direct["id"] == named
    assert routed.headers["x-request-id"] == rendered.json()["request_id"]
    stream = {**rendered.json(), "stream": True}
    with httpx.stream("POST", router.url + "/inference/v1/generate", json=stream, timeout=30) as r:
        ids = {json.loads(line[6:])["request_id"] for line in r.iter_lines() if line.startswith("data: {")}
    assert ids == {named}
    mine = httpx.post(
        router.url + "/inference/v1/generate", json=rendered.json(), headers={"X-Request-Id": "mine-2"}
    )
    assert mine.json()["id"] == "generate-tokens-mine-2"
    # A client's error is the answer: one replica saw it, none was asked again.
    retries = metric(router.url, "ferry:router_retries_total")
    seen = {u: r["total_requests"] for u, r in replicas_view(router).items()}
    bad = httpx.post(
        router.url + "/inference/v1/generate", json={"token_ids": [10**9], "sampling_params": {}}
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "token_ids"
    assert metric(router.url, "ferry:router_retries_total") == retries
    assert sum(r["total_requests"] - seen[u] for u, r in replicas_view(router).items()) == 1
    assert metric(router.url, "ferry:router_requests_total", {"status": "400"}) == 1


def test_limits_and_bad_input_are_clear_4xx(cluster: Cluster, pair: list[Proc]) -> None:
    a, _ = pair
    router = cluster.router("--replica", a.url, "--max-request-bytes", "2000")
    big = httpx.post(router.url + "/v1/completions", json={"model": MODEL, "prompt": "x" * 5000})
    assert big.status_code == 413 and big.json()["error"]["type"] == "RequestTooLargeError"
    bad, bad_direct = (
        httpx.post(
            url + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
        )
        for url in (router.url, a.url)
    )
    assert bad.status_code == bad_direct.status_code == 400 and "JSON" in bad.json()["error"]["message"]
    # The router's own errors are typed as the replica's are: a client reads one vocabulary.
    assert bad.json()["error"]["type"] == bad_direct.json()["error"]["type"] == "BadRequestError"
    arr = httpx.post(router.url + "/v1/chat/completions", json=[1, 2])
    assert arr.status_code == 400
    # The replica's own validation errors pass through untouched.
    neg = httpx.post(router.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -1})
    assert neg.status_code == 400 and "error" in neg.json()
    # Streams before this replica showed it answers return_token_ids (the router asks logprobs to
    # resume them): a body that needs the client's own logprobs is still the replica's 400.
    for path, needs in (
        ("/v1/chat/completions", {"top_logprobs": 2}),
        ("/v1/chat/completions", {"logprob_token_ids": [3]}),
        ("/v1/completions", {"logprob_token_ids": [3]}),
    ):
        prompt = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
        body = {"model": MODEL, "max_tokens": 2, "stream": True, **prompt, **needs}
        routed, direct = (httpx.post(url + path, json=body) for url in (router.url, a.url))
        assert routed.status_code == direct.status_code == 400, routed.text
        assert routed.json() == direct.json()
    # A body the cache_aware keyer cannot read still reaches the replica, which names the mistake.
    part = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}
    odd = httpx.post(router.url + "/v1/chat/completions", json=part)
    direct = httpx.post(a.url + "/v1/chat/completions", json=part)
    assert odd.status_code == direct.status_code == 400 and odd.json() == direct.json()
    assert httpx.get(router.url + "/nope").status_code == 404
    huge_header = httpx.get(router.url + "/health", headers={"x-junk": "y" * 70000})
    assert huge_header.status_code == 431  # --max-header-bytes (server/http_limits.py)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=BODIES, relay=RELAY_FIELDS, chat=st.booleans(), stream=st.booleans())
def test_fuzzed_bodies_never_get_a_5xx(
    cluster: Cluster,
    pair: list[Proc],
    fuzz_routers: list[Proc],
    body: dict,
    relay: dict,
    chat: bool,
    stream: bool,
) -> None:
    """Malformed and near-valid bodies through routers with and without a tokenizer: the answer is
    the replica's (a 4xx for a mistake, 200 when the body is valid), never a router 5xx."""
    payload = json.dumps({**body, "model": MODEL, "max_tokens": 2, "stream": stream, **relay}).encode()
    path = "/v1/chat/completions" if chat else "/v1/completions"
    for router in fuzz_routers:
        r = httpx.post(
            router.url + path, content=payload, headers={"content-type": "application/json"}, timeout=30
        )
        assert r.status_code < 500, (r.status_code, r.text[:300], payload[:300])


@pytest.fixture(scope="module")
def fuzz_routers(cluster: Cluster, pair: list[Proc]) -> list[Proc]:
    a, _ = pair
    return [
        cluster.router("--replica", a.url, "--model", str(cluster.model)),
        cluster.router("--replica", a.url),
    ]


def test_zero_replicas_then_admin_add_drain_remove(cluster: Cluster, pair: list[Proc]) -> None:
    a, b = pair
    router = cluster.router("--policy", "round_robin", "--api-key", "sekret")
    auth = {"Authorization": "Bearer sekret"}
    assert httpx.get(router.url + "/health").status_code == 503
    resp = httpx.post(router.url + "/v1/completions", headers=auth, json={"model": MODEL, "prompt": "x"})
    assert resp.status_code == 503 and "no replica is registered" in resp.json()["error"]["message"]
    assert resp.json()["error"]["type"] == "ServiceUnavailableError"  # vLLM's names, as every error
    assert resp.headers["retry-after"] == "1"
    assert httpx.post(router.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}).status_code == 401
    assert httpx.get(router.url + "/admin/replicas").status_code == 401

    added = httpx.post(router.url + "/admin/replicas", headers=auth, json={"url": a.url, "role": "mixed"})
    assert added.status_code == 201 and added.json()["health"] == "healthy"
    httpx.post(router.url + "/admin/replicas", headers=auth, json={"url": b.url})
    assert httpx.get(router.url + "/health").status_code == 200
    bad = httpx.post(router.url + "/admin/replicas", headers=auth, json={"url": a.url, "role": "chef"})
    assert bad.status_code == 400
    # URLs the relay could not reach are refused up front (they used to be added, then 500).
    for url, why in [
        ("http://[::1", "Invalid IPv6 URL"),
        ("http://127.0.0.1:99999", "Port out of range"),
        ("ftp://127.0.0.1:8000", "http(s)://host[:port] expected"),
        ("http://127.0.0.1:8000/prefix", "http(s)://host[:port] expected"),
    ]:
        refused = httpx.post(router.url + "/admin/replicas", headers=auth, json={"url": url})
        assert refused.status_code == 400 and why in refused.json()["error"]["message"]
    assert sorted(replicas_view_auth(router, auth)) == sorted([a.url, b.url])
    reset = httpx.post(router.url + "/reset_prefix_cache", headers=auth)
    assert reset.status_code == 200 and reset.json()["replicas"] == {a.url: 200, b.url: 200}

    drained = httpx.post(router.url + "/admin/replicas/drain", headers=auth, json={"url": a.url})
    assert drained.status_code == 200 and drained.json()["draining"] is True
    for _ in range(4):
        ok = httpx.post(
            router.url + "/v1/completions",
            headers=auth,
            json={"model": MODEL, "prompt": "x", "max_tokens": 1},
        )
        assert ok.status_code == 200
    view = replicas_view_auth(router, auth)
    assert view[a.url]["total_requests"] == 0 and view[b.url]["total_requests"] == 4

    gone = httpx.request("DELETE", router.url + "/admin/replicas", headers=auth, json={"url": b.url})
    assert gone.status_code == 200
    resp = httpx.post(router.url + "/v1/completions", headers=auth, json={"model": MODEL, "prompt": "x"})
    assert resp.status_code == 503 and "none routable" in resp.json()["error"]["message"]
    missing = httpx.request("DELETE", router.url + "/admin/replicas", headers=auth, json={"url": b.url})
    assert missing.status_code == 404


def replicas_view_auth(router: Proc, auth: dict) -> dict[str, dict]:
    return {r["url"]: r for r in httpx.get(router.url + "/admin/replicas", headers=auth).json()["replicas"]}


def test_client_disconnect_cancels_the_upstream_request(cluster: Cluster, pair: list[Proc]) -> None:
    a, _ = pair
    router = cluster.router("--replica", a.url)
    before = metric(a.url, "vllm:generation_tokens_total")
    body = {"model": MODEL, "prompt": "count", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=30) as resp:
        for i, _line in enumerate(resp.iter_lines()):
            if i >= 6:
                break
    assert wait_until(lambda: metric(a.url, "vllm:num_requests_running") == 0, timeout=60)
    time.sleep(0.5)
    generated = metric(a.url, "vllm:generation_tokens_total") - before
    assert generated < 600, f"the replica kept generating after the client left ({generated} tokens)"
    assert wait_until(lambda: metric(router.url, "ferry:router_inflight", {"replica": a.url}) == 0)
    # Non-streamed requests are cancelled too (cut short, not run to their 900 tokens).
    before = metric(a.url, "vllm:generation_tokens_total")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(router.url + "/v1/completions", json={**body, "stream": False}, timeout=0.3)
    assert wait_until(lambda: metric(a.url, "vllm:num_requests_running") == 0, timeout=60)
    time.sleep(0.5)
    generated = metric(a.url, "vllm:generation_tokens_total") - before
    assert generated < 600, f"the replica kept generating after the client left ({generated} tokens)"
    # A client that leaves says nothing about the replica: no circuit failure, counted as 499.
    assert wait_until(lambda: metric(router.url, "ferry:router_requests_total", {"status": "499"}) == 2)
    view = replicas_view(router)[a.url]
    assert view["failures"] == 0 and view["circuit"] == "closed" and view["inflight"] == 0
    assert view["prefilling"] == 0


def test_overload_gets_429_with_retry_after(cluster: Cluster, pair: list[Proc]) -> None:
    a, _ = pair
    router = cluster.router("--replica", a.url, "--max-concurrency", "1", "--max-queue", "0")
    body = {"model": MODEL, "prompt": "count", "max_tokens": 900, "ignore_eos": True, "stream": True}
    got = {}

    def long_stream() -> None:
        with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=30) as resp:
            got["status"] = resp.status_code
            for _ in resp.iter_lines():
                pass

    t = threading.Thread(target=long_stream)
    t.start()
    assert wait_until(lambda: metric(router.url, "ferry:router_inflight", {"replica": a.url}) == 1)
    refused = httpx.post(
        router.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}
    )
    t.join()
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "RateLimitError"
    assert got["status"] == 200
    assert metric(router.url, "ferry:router_rejected_total") == 1


def test_router_health_metrics_and_models(cluster: Cluster, pair: list[Proc]) -> None:
    a, b = pair
    router = cluster.router("--replica", a.url, "--replica", b.url)
    assert httpx.get(router.url + "/health").json()["replicas"] == {"total": 2, "routable": 2}
    assert httpx.get(router.url + "/v1/models").json()["data"][0]["id"] == MODEL  # deduplicated
    assert len(httpx.get(router.url + "/v1/models").json()["data"]) == 1
    # CORS as a replica answers it (any origin by default), before anything else.
    pre = httpx.options(
        router.url + "/v1/completions",
        headers={"Origin": "http://ui.example", "Access-Control-Request-Method": "POST"},
    )
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "*"
    card = httpx.get(router.url + f"/v1/models/{MODEL}")
    assert card.status_code == 200 and card.json()["id"] == MODEL
    missing = httpx.get(router.url + "/v1/models/org%2Fother")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert "org/other" in missing.json()["error"]["message"]
    text = httpx.get(router.url + "/metrics").text
    for name in (
        "ferry:router_requests_total",
        "ferry:router_request_latency_seconds",
        "ferry:router_ttft_seconds",
        "ferry:router_retries_total",
        "ferry:router_failovers_total",
        "ferry:router_replica_healthy",
        "ferry:router_cache_hit_tokens_total",
    ):
        assert name in text
    assert metric(router.url, "ferry:router_replica_healthy", {"replica": a.url}) == 1
    stream = httpx.post(
        router.url + "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "stream": True,
        },
    )
    assert stream.text.endswith("data: [DONE]\n\n")
    assert json.loads(stream.text.split("\n\n")[1][6:])["choices"][0]["logprobs"] is None
    assert metric(router.url, "ferry:router_ttft_seconds_count") == 1


def test_router_does_not_import_torch_and_starts_fast(tiny_llama) -> None:
    import subprocess
    import sys

    code = (
        "import sys, time; t = time.perf_counter();"
        "import router.app, router.main, router.kv_events, router.discovery_redis, kvcache.events;"
        "from router.config import RouterConfig;"
        f"app = router.app.RouterApp(RouterConfig(policy='cache_aware', model={str(tiny_llama)!r},"
        " replicas=('http://127.0.0.1:1',), discovery='redis://127.0.0.1:1/0', kv_tier='redis://127.0.0.1:1/0'));"
        "assert app.keyer.keys('/v1/completions', {'prompt': 'hello ' * 40})[0];"
        "assert 'torch' not in sys.modules, 'torch was imported';"
        "assert 'httpx' not in sys.modules, 'httpx was imported';"
        "print(time.perf_counter() - t)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    # Typically ~0.4 s; the bound only catches a heavy import (torch alone is seconds), and a
    # loaded 2-core CI machine running two test workers took 3.2 s once.
    assert float(out.stdout) < 10.0


def test_cache_aware_follows_prefixes_and_spreads_a_flood(cluster: Cluster, pair: list[Proc]) -> None:
    a, b = pair
    router = cluster.router(
        "--replica",
        a.url,
        "--replica",
        b.url,
        "--policy",
        "cache_aware",
        "--model",
        str(cluster.model),
        "--block-size",
        "16",
        "--balance-abs-threshold",
        "2",
    )
    c = client(router.url)
    systems = {
        name: f"{name.upper()} {name} speaking. You are assistant {name}. "
        + " ".join(f"rule {i} for {name}." for i in range(40))
        for name in ("alpha", "beta")
    }
    convs = {name: [{"role": "system", "content": s}] for name, s in systems.items()}
    placed: dict[str, set[str]] = {"alpha": set(), "beta": set()}
    cached: list[int] = []
    for turn in range(3):
        for name, msgs in convs.items():
            msgs.append({"role": "user", "content": f"question {turn} from {name}"})
            before = {u: r["total_requests"] for u, r in replicas_view(router).items()}
            hits_before = metric(router.url, "ferry:router_cache_hit_tokens_total")
            r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
            after = replicas_view(router)
            placed[name] |= {u for u in after if after[u]["total_requests"] > before[u]}
            msgs.append({"role": "assistant", "content": r.choices[0].message.content})
            predicted = metric(router.url, "ferry:router_cache_hit_tokens_total") - hits_before
            if turn > 0:
                actual = r.usage.prompt_tokens_details.cached_tokens
                assert predicted > 200 and actual >= predicted  # the router's prediction held
                cached.append(actual)
    # Each conversation stayed on one replica, and the two went to different replicas.
    assert len(placed["alpha"]) == 1 and len(placed["beta"]) == 1 and placed["alpha"] != placed["beta"]
    assert len(cached) == 4

    # A flood of one hot prefix (concurrent) must not pile onto its holder.
    import concurrent.futures

    before = {u: r["total_requests"] for u, r in replicas_view(router).items()}
    msgs = convs["alpha"][:1]

    def one(i: int) -> str:
        r = c.chat.completions.create(
            model=MODEL,
            messages=[*msgs, {"role": "user", "content": f"flood {i}"}],
            max_tokens=40,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        return r.choices[0].finish_reason

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        assert list(pool.map(one, range(12))) == ["length"] * 12
    after = replicas_view(router)
    got = {u: after[u]["total_requests"] - before[u] for u in after}
    assert sum(got.values()) == 12 and min(got.values()) >= 3, got


def test_cache_aware_keeps_a_generate_rollout_on_its_prefix(cluster: Cluster, pair: list[Proc]) -> None:
    """vLLM's tokens-in/tokens-out generate, as RL frameworks drive a multi-turn rollout: each turn's
    ``token_ids`` extend the last turn's prompt and answer. The router keys them as the replica's own
    block hashes, so each turn lands where its prefix is cached, and the replica says it was."""
    a, b = pair
    router = cluster.router(
        "--replica",
        a.url,
        "--replica",
        b.url,
        "--policy",
        "cache_aware",
        "--model",
        str(cluster.model),
        "--block-size",
        "16",
        "--balance-abs-threshold",
        "2",
    )

    def ids(text: str) -> list[int]:
        body = {"model": MODEL, "prompt": text, "add_special_tokens": False}
        return httpx.post(a.url + "/tokenize", json=body, timeout=30).json()["tokens"]

    rollouts = {
        name: ids(f"{name.upper()} rollout. " + " ".join(f"step {i} of {name}." for i in range(40)))
        for name in ("gamma", "delta")
    }
    placed: dict[str, set[str]] = {name: set() for name in rollouts}
    for turn in range(3):
        for name, prompt in rollouts.items():
            before = {u: r["total_requests"] for u, r in replicas_view(router).items()}
            hits_before = metric(router.url, "ferry:router_cache_hit_tokens_total")
            body = {
                "model": MODEL,
                "token_ids": prompt,
                "sampling_params": {"max_tokens": 8, "temperature": 0},
            }
            r = httpx.post(router.url + "/inference/v1/generate", json=body, timeout=60)
            assert r.status_code == 200, r.text
            out = r.json()
            after = replicas_view(router)
            placed[name] |= {u for u in after if after[u]["total_requests"] > before[u]}
            predicted = metric(router.url, "ferry:router_cache_hit_tokens_total") - hits_before
            assert out["usage"]["prompt_tokens"] == len(prompt)
            if turn > 0:  # every earlier full block: the last turn's prompt, at least
                actual = out["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert predicted >= 200 and predicted % 16 == 0 and actual >= predicted
            else:
                assert predicted == 0
            (choice,) = out["choices"]
            assert len(choice["token_ids"]) == 8 or choice["finish_reason"] == "stop"
            rollouts[name] = [*prompt, *choice["token_ids"], *ids(f" Observation {turn} for {name}.")]
    # Each rollout stayed on one replica, and the two went to different replicas.
    assert len(placed["gamma"]) == 1 and len(placed["delta"]) == 1 and placed["gamma"] != placed["delta"]


def test_session_policy_sticks_by_header_and_body_fields(cluster: Cluster, pair: list[Proc]) -> None:
    a, b = pair
    router = cluster.router("--replica", a.url, "--replica", b.url, "--policy", "session")
    from router.policies.session import rendezvous_pick

    for key, how in (
        ("alice", "header"),
        ("bob", "header"),
        ("carol", "user"),
        ("dave", "user"),
        ("erin", "prompt_cache_key"),  # OpenAI's field for keeping a conversation on one cache
        ("frank", "safety_identifier"),
        ("ivan", "session_id"),  # vLLM's stable session identity
    ):
        before = {u: r["total_requests"] for u, r in replicas_view(router).items()}
        for _ in range(3):
            body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
            headers = {}
            if how == "header":
                headers["X-Session-Id"] = key
            else:
                body[how] = key
            assert httpx.post(router.url + "/v1/completions", json=body, headers=headers).status_code == 200
        after = replicas_view(router)
        got = {u for u in after if after[u]["total_requests"] > before[u]}
        assert got == {rendezvous_pick(key, [a.url, b.url])}  # all three on the session's replica
    # session_id comes before the other body fields (on a chat too): keys are picked whose replica
    # differs from the one the other field would choose.
    urls = [a.url, b.url]
    for other in ("prompt_cache_key", "user"):
        key = next(
            k
            for k in ("judy", "ken", "liam", "mia", "noor")
            if rendezvous_pick(k, urls) != rendezvous_pick(other, urls)
        )
        body = {"session_id": key, other: other}
        before = {u: r["total_requests"] for u, r in replicas_view(router).items()}
        for path, extra in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": HI})):
            r = httpx.post(router.url + path, json={"model": MODEL, "max_tokens": 1, **body, **extra})
            assert r.status_code == 200, r.text
        after = replicas_view(router)
        assert {u for u in after if after[u]["total_requests"] > before[u]} == {rendezvous_pick(key, urls)}
    for key in ("grace", "heidi"):  # vLLM's generate has no body field for it: the header
        before = {u: r["total_requests"] for u, r in replicas_view(router).items()}
        for _ in range(3):
            body = {"model": MODEL, "token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 1}}
            r = httpx.post(router.url + "/inference/v1/generate", json=body, headers={"X-Session-Id": key})
            assert r.status_code == 200, r.text
        after = replicas_view(router)
        assert {u for u in after if after[u]["total_requests"] > before[u]} == {
            rendezvous_pick(key, [a.url, b.url])
        }


@pytest.mark.parametrize("policy", ["least_load", "power_of_two"])
def test_load_policies_serve_through_the_cli(cluster: Cluster, pair: list[Proc], policy: str) -> None:
    a, b = pair
    router = cluster.router("--replica", a.url, "--replica", b.url, "--policy", policy)
    for _ in range(4):
        r = httpx.post(router.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1})
        assert r.status_code == 200
    view = replicas_view(router)
    assert sum(v["total_requests"] for v in view.values()) == 4
    assert all(v["inflight"] == 0 for v in view.values())


def test_router_block_hashes_equal_the_replicas(cluster: Cluster, pair: list[Proc]) -> None:
    """cache_aware's keys are the replica's own block hashes (same template, tokenizer, hashing)."""
    from kvcache.keys import to_hex
    from router.prompt_keys import TokenKeyer

    a, _ = pair
    keyer = TokenKeyer.from_dir(str(cluster.model), 16)
    chat = {
        "model": MODEL,
        "max_tokens": 1,
        "kv_transfer": {"role": "producer"},
        "messages": [{"role": "system", "content": "be brief " * 30}, {"role": "user", "content": "hello?"}],
    }
    comp = {
        "model": MODEL,
        "max_tokens": 1,
        "kv_transfer": {"role": "producer"},
        "prompt": "def f(x):\n" * 20,
    }
    # Bodies the template sees differently unless router and replica normalise alike: null
    # content, text parts with extra keys, unknown message fields, a null add_generation_prompt,
    # continue_final_message.
    odd_chat = {
        "model": MODEL,
        "max_tokens": 1,
        "kv_transfer": {"role": "producer"},
        "add_generation_prompt": None,
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "be brief " * 20, "cache": "x"}]},
            {"role": "user", "content": "hello?", "metadata": {"k": 1}},
            {"role": "assistant", "content": None},
            {"role": "user", "content": [{"type": "text", "text": "again"}, {"type": "text", "text": "!"}]},
        ],
    }
    continued = {
        "model": MODEL,
        "max_tokens": 1,
        "kv_transfer": {"role": "producer"},
        "add_generation_prompt": False,
        "continue_final_message": True,
        "messages": [
            {"role": "user", "content": "write a long list " * 10},
            {"role": "assistant", "content": "Sure: one, two,"},
        ],
    }
    bodies = [("/v1/chat/completions", chat), ("/v1/chat/completions", odd_chat)]
    bodies += [("/v1/chat/completions", continued), ("/v1/completions", comp)]
    for path, body in bodies:
        answer = httpx.post(a.url + path, json=body, timeout=30).json()
        hashes, tokens = keyer.keys(path, body)
        assert len(hashes) >= 4 and tokens == answer["usage"]["prompt_tokens"]
        assert to_hex(hashes) == answer["kv_transfer"]["block_hashes"]


def test_drain_lets_in_flight_streams_finish(cluster: Cluster, pair: list[Proc]) -> None:
    a, b = pair
    router = cluster.router("--replica", a.url, "--replica", b.url, "--policy", "round_robin")
    body = {"model": MODEL, "prompt": "count", "max_tokens": 300, "ignore_eos": True, "stream": True}
    finishes, n, text = [], 0, ""
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            n += 1
            if n == 3:  # mid-stream: the first request went to a (round robin); drain it
                drained = httpx.post(router.url + "/admin/replicas/drain", json={"url": a.url})
                assert drained.json()["draining"] is True and drained.json()["inflight"] == 1
                # Past its first content the request no longer waits on a's queue.
                assert drained.json()["prefilling"] == (0 if text else 1)
                for _ in range(2):  # new work goes to b only
                    r = httpx.post(
                        router.url + "/v1/completions", json={"model": MODEL, "prompt": "y", "max_tokens": 1}
                    )
                    assert r.status_code == 200
            choices = json.loads(line[6:])["choices"]
            finishes += [c["finish_reason"] for c in choices if c["finish_reason"]]
            text += "".join(c["text"] for c in choices)
    assert finishes == ["length"]
    assert metric(router.url, "ferry:router_failovers_total") == 0
    view = replicas_view(router)
    assert (
        view[a.url]["total_requests"] == 1
        and view[b.url]["total_requests"] == 2
        and view[a.url]["inflight"] == 0
    )
    assert view[a.url]["prefilling"] == view[b.url]["prefilling"] == 0


def test_prefill_decode_pools_without_mixed_serve_whole_requests(cluster: Cluster, pair: list[Proc]) -> None:
    a, b = pair
    router = cluster.router("--prefill", a.url, "--decode", b.url, "--policy", "round_robin")
    assert wait_until(lambda: httpx.get(router.url + "/health").status_code == 200)
    for _ in range(2):
        r = httpx.post(router.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert r.status_code == 200
    view = replicas_view(router)
    assert view[b.url]["role"] == "decode" and view[b.url]["total_requests"] == 2
    assert view[a.url]["role"] == "prefill" and view[a.url]["total_requests"] == 0 and view[a.url]["routable"]


def test_reset_prefix_cache_fans_out_to_every_replica(cluster: Cluster, pair: list[Proc]) -> None:
    a, b = pair
    router = cluster.router("--replica", a.url, "--replica", b.url, "--policy", "round_robin")
    prompt = "the same long prompt " * 8
    for _ in range(2):  # one request per replica (round robin): both cache the prompt's blocks
        r = httpx.post(
            router.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}
        )
        assert r.status_code == 200
    r = httpx.post(router.url + "/reset_prefix_cache", timeout=30)
    assert r.status_code == 200
    assert r.json()["replicas"] == {a.url: 200, b.url: 200}
    # Both replicas start cold again: the same prompt on each reports no cached tokens.
    for _ in range(2):
        r = httpx.post(
            router.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}
        )
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_cache_aware_routes_responses_api_requests_by_their_prompt(
    cluster: Cluster, pair: list[Proc]
) -> None:
    """/v1/responses bodies are keyed as the replica renders them (instructions and input as chat
    messages): a conversation's turns land where its prefix is cached, relayed as they come."""
    a, b = pair
    router = cluster.router(
        "--replica", a.url, "--replica", b.url, "--policy", "cache_aware", "--model", str(cluster.model),
        "--block-size", "16", "--balance-abs-threshold", "2",
    )  # fmt: skip
    c = client(router.url)
    placed: dict[str, set[str]] = {"alpha": set(), "beta": set()}
    for turn in range(3):
        for name in placed:
            instructions = f"{name.upper()} speaking. " + " ".join(f"rule {i} for {name}." for i in range(40))
            before = {u: r["total_requests"] for u, r in replicas_view(router).items()}
            hits_before = metric(router.url, "ferry:router_cache_hit_tokens_total")
            kw = dict(model=MODEL, instructions=instructions, input=f"question {turn}", max_output_tokens=4)
            if turn == 2:  # streamed too: relayed event by event
                kinds = [e.type for e in c.responses.create(stream=True, **kw)]
                assert kinds[0] == "response.created" and kinds[-1] in (
                    "response.completed",
                    "response.incomplete",
                )
            else:
                r = c.responses.create(**kw)
                assert r.usage.input_tokens > 200
            after = replicas_view(router)
            placed[name] |= {u for u in after if after[u]["total_requests"] > before[u]}
            if turn > 0:
                assert metric(router.url, "ferry:router_cache_hit_tokens_total") - hits_before > 200
    assert len(placed["alpha"]) == 1 and len(placed["beta"]) == 1 and placed["alpha"] != placed["beta"]


def test_a_stored_response_chain_follows_its_replica(cluster: Cluster, pair: list[Proc]) -> None:
    """Replicas keep responses in their own memory (the default store): round robin alone would
    send every other turn of a previous_response_id chain to a replica that never saw it (404).
    The router sends what names a response to the replica that answered it."""
    a, b = pair
    router = cluster.router("--replica", a.url, "--replica", b.url, "--policy", "round_robin")
    c = client(router.url)
    greedy = dict(model=MODEL, max_output_tokens=4, temperature=0)
    # A request id a replica could not take: the router takes one of its own, as a replica would,
    # and follows the response named after it.
    previous = c.responses.create(input="Turn 0", extra_headers={"X-Request-Id": "not an id!"}, **greedy)
    assert previous.id != "resp_not an id!"
    owner = {u for u, r in replicas_view(router).items() if r["total_requests"] == 1}
    assert len(owner) == 1
    for turn in range(1, 5):
        kw = dict(previous_response_id=previous.id, input=f"Turn {turn}", **greedy)
        # The last two turns are named by vLLM's request_id field: the router follows that name.
        named = {"request_id": f"turn{turn}-{time.monotonic_ns()}"} if turn >= 3 else {}
        if turn == 3:  # streamed
            events = list(c.responses.create(stream=True, extra_body=named, **kw))
            assert events[-1].type in ("response.completed", "response.incomplete")
            previous = events[-1].response
        else:
            previous = c.responses.create(extra_body=named, **kw)
        assert previous.id == named.get("request_id", previous.id)
        assert previous.usage.input_tokens > 8 * turn
    view = replicas_view(router)
    assert {u for u, r in view.items() if r["total_requests"] == 5} == owner  # all five turns
    # Reads and deletes follow too; a plain request still goes round robin.
    for _ in range(3):
        assert c.responses.retrieve(previous.id).id == previous.id
        assert len(c.responses.input_items.list(previous.id, limit=3).data) == 3
    c.responses.delete(previous.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(previous.id)  # forgotten by the router, gone from its replica
    name = "ferry:router_response_affinity_total"
    assert metric(router.url, name, {"outcome": "hit"}) == 4 + 3 * 2 + 1  # turns, reads, the delete
    assert metric(router.url, name, {"outcome": "miss"}) == 1  # the read after the delete
    c.responses.create(input="elsewhere", **greedy)
    after = replicas_view(router)
    assert sum(r["total_requests"] for u, r in after.items() if u not in owner) >= 1


def test_a_background_response_is_polled_resumed_and_cancelled_on_its_replica(
    cluster: Cluster, pair: list[Proc]
) -> None:
    """Background responses live in their replica's memory: polls, resumed streams and cancels go
    there (round robin alone would send every other one to the replica that never saw it: 404)."""
    a, b = pair
    router = cluster.router("--replica", a.url, "--replica", b.url, "--policy", "round_robin")
    c = client(router.url)
    kw = dict(model=MODEL, input="Resume me", max_output_tokens=12, temperature=0)
    first = first_events(c.responses.create(background=True, stream=True, **kw), 3)
    response_id = first[0].response.id
    for _ in range(2):  # each read from its replica
        rest = list(c.responses.retrieve(response_id, stream=True, starting_after=2))
        assert [e.sequence_number for e in first + rest] == list(range(len(first) + len(rest)))
        assert rest[-1].type in ("response.completed", "response.incomplete")
    named = f"long-{time.monotonic_ns()}"  # vLLM's request_id field names it: the router follows
    long = c.responses.create(
        model=MODEL,
        input="x",
        max_output_tokens=900,
        background=True,
        extra_body={"ignore_eos": True, "request_id": named},
    )
    assert long.id == named
    wait_in_progress(c, long.id)
    cancelled = c.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and 0 < cancelled.usage.output_tokens < 900
    assert c.responses.cancel(long.id) == cancelled  # twice in a row: not round robin's two replicas
    assert c.responses.retrieve(long.id).status == "cancelled"
    assert metric(a.url, "vllm:num_requests_running") + metric(b.url, "vllm:num_requests_running") == 0


def test_referenced_responses_and_the_affinity_bound() -> None:
    from router.response_affinity import ResponseAffinity, referenced_response
    from server.middleware import response_id_for

    assert referenced_response("POST", "/v1/responses", {"previous_response_id": "resp_1"}) == "resp_1"
    assert referenced_response("POST", "/v1/responses", {"input": "x"}) is None
    assert referenced_response("POST", "/v1/responses", {"previous_response_id": 7}) is None
    assert referenced_response("GET", "/v1/responses/resp_2", None) == "resp_2"
    assert referenced_response("DELETE", "/v1/responses/resp_2", None) == "resp_2"
    assert referenced_response("GET", "/v1/responses/resp_3/input_items", None) == "resp_3"
    assert referenced_response("POST", "/v1/responses/resp_4/cancel", None) == "resp_4"
    assert referenced_response("GET", "/v1/responses/resp_3/other", None) is None
    assert referenced_response("GET", "/v1/responses/", None) is None
    assert response_id_for("abc") == "resp_abc"
    affinity = ResponseAffinity(max_entries=2)
    affinity.remember("r1", "http://a")
    affinity.remember("r2", "http://b")
    assert affinity.lookup("r1") == "http://a"  # r1 is now the most recently used
    affinity.remember("r3", "http://a")
    assert affinity.lookup("r2") is None and len(affinity) == 2
    affinity.forget("r1")
    assert affinity.lookup("r1") is None and affinity.lookup("r3") == "http://a"


def test_files_and_batches_go_to_one_replica(cluster: Cluster, pair: list[Proc]) -> None:
    """A replica keeps its files and runs its batches itself: through a round-robin router every
    Files and Batches API request goes to the replica with the lowest URL, so each id resolves and
    lists are whole (round robin alone would send every other request where the id is unknown)."""
    import io

    a, b = pair
    router = cluster.router("--replica", a.url, "--replica", b.url, "--policy", "round_robin")
    c = client(router.url)
    home, other = sorted([a.url, b.url])
    line = {"custom_id": "one", "method": "POST", "url": "/v1/completions"}
    line["body"] = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "temperature": 0}
    upload = c.files.create(file=("in.jsonl", io.BytesIO(json.dumps(line).encode())), purpose="batch")
    batch = c.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    for _ in range(4):  # round robin would alternate
        assert c.files.retrieve(upload.id).id == upload.id
        assert batch.id in [x.id for x in c.batches.list()]
    assert wait_until(lambda: c.batches.retrieve(batch.id).status == "completed", 30)
    done = c.batches.retrieve(batch.id)
    out = json.loads(c.files.content(done.output_file_id).text)
    assert out["custom_id"] == "one" and out["response"]["body"]["usage"]["completion_tokens"] == 3
    assert client(home).files.retrieve(upload.id).id == upload.id
    with pytest.raises(openai.NotFoundError):
        client(other).files.retrieve(upload.id)
    # Pinning Files/Batches requests is not the Responses API's affinity.
    assert not metric(router.url, "ferry:router_response_affinity_total", {"outcome": "hit"})
