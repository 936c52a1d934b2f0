"""LoRA adapters behind `ferry router`: a request for an adapter goes only to the replicas that list
it (read again from their ``/v1/models`` as adapters come and go), and the router keys an adapter's
prompts with the block hashes its replica gives them."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from router_harness import Cluster, Proc, free_port, metric, replica_args, replicas_view, wait_until

from engine.demo import build_lora_adapter
from kvcache.keys import to_hex
from router.health import HealthChecker
from router.metrics import RouterMetrics
from router.pool import Replicas, serving
from router.prompt_keys import TokenKeyer
from router.upstream import UpstreamClient

PROMPT_IDS = list(range(5, 45))  # 40 tokens: 2 full blocks of 16


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, tiny_llama: Path) -> Path:
    return build_lora_adapter(tmp_path_factory.mktemp("lora") / "a", tiny_llama, seed=1, alpha=32)


RESOLVED = ("r1", "r2", "r3", "r4")


@pytest.fixture(scope="module")
def resolver_dir(tmp_path_factory, tiny_llama: Path) -> Path:
    """The second replica's --lora-resolver-dir: adapter "r", and links to it named ``RESOLVED``."""
    root = tmp_path_factory.mktemp("resolver")
    build_lora_adapter(root / "r", tiny_llama, seed=3, alpha=32)
    for name in RESOLVED:
        (root / name).symlink_to(root / "r")
    return root


# In both resolving replicas' directories (each its own copy): "both" a copy of adapter "a"'s files,
# "both1".."both4" links to it; in one only: "only_without", "only_other", "only_other2" and "pd_only_other".
BOTH = ("both", "both1", "both2", "both3", "both4")


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory, resolver_dir: Path, adapter: Path) -> Path:
    """The third replica's --lora-resolver-dir; ``BOTH`` go into ``resolver_dir`` too."""
    root = tmp_path_factory.mktemp("resolver_other")
    for d in (resolver_dir, root):
        shutil.copytree(adapter, d / "both")
        for name in BOTH[1:]:
            (d / name).symlink_to(d / "both")
    (resolver_dir / "only_without").symlink_to(resolver_dir / "r")
    shutil.copytree(resolver_dir / "r", root / "only_other")
    for name in ("only_other2", "pd_only_other"):
        (root / name).symlink_to(root / "only_other")
    return root


def _start(cluster: Cluster, *flags: str) -> Proc:
    port = free_port()
    p = Proc(replica_args(cluster.model, port, *flags), port, cluster.tmp / f"replica-{port}.log").start()
    cluster.procs.append(p)
    return p


@pytest.fixture(scope="module")
def replicas(cluster: Cluster, adapter: Path, resolver_dir: Path, other_dir: Path, redis_server) -> tuple:
    """with_a (adapter "a" from --lora-modules), without and other (resolving, each from its own
    directory, on one Redis KV tier: a prefill and a decode worker for the PD test). Started
    together, loaded in parallel."""
    resolving = ("--enable-lora", "--allow-runtime-lora-updating", "--lora-resolver-dir")
    tier = ("--kv-tier", redis_server.url.rsplit("/", 1)[0] + "/7")  # a database no other module uses
    started = (
        _start(cluster, "--enable-lora", "--lora-modules", f"a={adapter}", "--kv-tier", "memory://"),
        _start(cluster, *resolving, str(resolver_dir), *tier),
        _start(cluster, *resolving, str(other_dir), *tier),
    )
    for p in started:
        p.wait_http()
    return started


@pytest.fixture(scope="module")
def setup(cluster: Cluster, replicas: tuple) -> Iterator[tuple]:
    with_a, without, _ = replicas
    router = cluster.router("--replica", with_a.url, "--replica", without.url, "--policy", "round_robin")
    assert wait_until(lambda: "a" in replicas_view(router).get(with_a.url, {}).get("models", []), 30)
    assert wait_until(lambda: all(r["routable"] for r in replicas_view(router).values()), 30)
    yield with_a, without, router


def _served(router, replica) -> float:
    return metric(router.url, "ferry:router_requests_total", {"replica": replica.url})


def _send(router, model: str, n: int) -> None:
    for _ in range(n):
        r = httpx.post(
            router.url + "/v1/completions",
            json={"model": model, "prompt": "hello", "max_tokens": 2},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model


def test_an_adapter_goes_only_where_it_is_served(setup, adapter: Path) -> None:
    with_a, without, router = setup
    base = httpx.get(with_a.url + "/v1/models").json()["data"][0]["id"]
    before = {r.url: _served(router, r) for r in (with_a, without)}
    _send(router, "a", 6)
    assert _served(router, with_a) - before[with_a.url] == 6
    assert _served(router, without) == before[without.url]
    _send(router, base, 4)  # the base model: both, in turn
    assert _served(router, with_a) - before[with_a.url] == 8
    assert _served(router, without) - before[without.url] == 2
    # vLLM's tokens-in/tokens-out generate names its model as a completion does: routed alike.
    for _ in range(4):
        body = {"model": "a", "token_ids": PROMPT_IDS, "sampling_params": {"max_tokens": 2}}
        r = httpx.post(router.url + "/inference/v1/generate", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "a", r.text
    assert _served(router, with_a) - before[with_a.url] == 12
    assert _served(router, without) - before[without.url] == 2
    # Loaded on the other replica at run time: the router reads it there and spreads the adapter.
    load = {"lora_name": "a", "lora_path": str(adapter)}
    assert httpx.post(without.url + "/v1/load_lora_adapter", json=load).status_code == 200
    assert wait_until(lambda: "a" in replicas_view(router)[without.url]["models"], 60)
    before = {r.url: _served(router, r) for r in (with_a, without)}
    _send(router, "a", 4)
    assert _served(router, with_a) - before[with_a.url] == 2
    assert _served(router, without) - before[without.url] == 2


def test_a_name_no_replica_lists_goes_to_a_resolving_replica(setup) -> None:
    with_a, without, router = setup
    view = replicas_view(router)
    assert (view[with_a.url]["lora_resolver"], view[without.url]["lora_resolver"]) == (False, True)
    before = {r.url: _served(router, r) for r in (with_a, without)}
    for name in RESOLVED:  # round_robin would send every other one to the replica without a resolver
        _send(router, name, 1)
    assert _served(router, with_a) == before[with_a.url]
    assert _served(router, without) - before[without.url] == len(RESOLVED)
    # Learnt from the replica's /v1/models, and listed by the router.
    assert wait_until(lambda: set(RESOLVED) <= set(replicas_view(router)[without.url]["models"]), 30)
    assert set(RESOLVED) <= {m["id"] for m in httpx.get(router.url + "/v1/models").json()["data"]}
    assert set(RESOLVED).isdisjoint(replicas_view(router)[with_a.url]["models"])  # followed, not spread
    # In no replica's directory either: the resolving replica's 404.
    r = httpx.post(router.url + "/v1/completions", json={"model": "nope", "prompt": "hi", "max_tokens": 2})
    assert (r.status_code, r.json()["error"]["code"]) == (404, "model_not_found")
    assert _served(router, with_a) == before[with_a.url]


async def test_the_router_keys_an_adapters_prompt_as_its_replica(setup, tiny_llama: Path) -> None:
    with_a, _, _ = setup
    replicas = Replicas()
    replica, _ = replicas.add(with_a.url)
    client = UpstreamClient(5.0, 5.0)
    assert await HealthChecker(replicas, client, RouterMetrics(), 5.0).probe(replica)
    keyer = TokenKeyer.from_dir(str(tiny_llama), 16)
    keyer.model_extra = replicas.lora_extra
    body = {"prompt": PROMPT_IDS, "max_tokens": 1, "kv_transfer": {"role": "producer"}}
    hashes = {}
    for model in ("a", httpx.get(with_a.url + "/v1/models").json()["data"][0]["id"]):
        answer = httpx.post(with_a.url + "/v1/completions", json={**body, "model": model}, timeout=60).json()
        hashes[model] = answer["kv_transfer"]["block_hashes"]
        assert len(hashes[model]) == 2
        assert (
            to_hex(keyer.keys("/v1/completions", {"model": model, "prompt": PROMPT_IDS})[0]) == hashes[model]
        )
        generate = {"model": model, "token_ids": PROMPT_IDS, "sampling_params": {}}
        assert to_hex(keyer.keys("/inference/v1/generate", generate)[0]) == hashes[model]
    assert hashes["a"] != next(v for k, v in hashes.items() if k != "a")


def test_a_resolving_replicas_answer_lists_the_name_there_at_once() -> None:
    """The relay's bookkeeping (``router/relay.py``), exact in a way the live tests cannot time: a
    resolving replica's 2xx for a name it did not list lists it there at once and has its
    ``/v1/models`` read at the next probe; requests sent before that answer follow the first one
    (``Pool.resolving``) until an answer from it settles the name."""
    from router.relay import _follow, _following, _learn_resolved, _settle

    replicas = Replicas()
    resolving, _ = replicas.add("http://127.0.0.1:7401")
    other, _ = replicas.add("http://127.0.0.1:7403")
    plain, _ = replicas.add("http://127.0.0.1:7402")
    resolving.lora_resolver = other.lora_resolver = True
    for r in (resolving, other, plain):
        r.models, r.models_read_at = ["m", "a"], 100.0
    pool = replicas.pools["mixed"]
    _follow(pool, resolving, "x")
    _follow(pool, resolving, "x")  # a second request, sent there while the first had no answer
    assert pool.resolving == {"x": (resolving.url, 2)}
    assert _following(pool, "x", [other, resolving, plain]) is resolving
    assert _following(pool, "x", [other, plain]) is None  # not a candidate (tried, down): the policy picks
    assert _following(pool, "y", [other, resolving]) is None
    _settle(pool, resolving, "x", ended=False)  # a client left: the other request still follows it
    assert pool.resolving == {"x": (resolving.url, 1)}
    _settle(pool, other, "x")  # another replica's answer does not settle this one
    assert pool.resolving == {"x": (resolving.url, 1)}
    _learn_resolved(pool, resolving, "x", 404, 200.0)  # not found there: the next request picks again
    assert (pool.resolving, resolving.models, resolving.models_read_at) == ({}, ["m", "a"], 100.0)
    _follow(pool, resolving, "x")
    _learn_resolved(pool, resolving, "x", 200, 200.0)
    assert pool.resolving == {}
    assert (resolving.models, resolving.lora_resolved, resolving.models_read_at) == (
        ["m", "a", "x"],
        {"x": 200.0},
        float("-inf"),
    )
    assert _following(pool, "x", [resolving]) is None  # listed now: routed as any listed adapter
    # Listed only by a replica that cannot take it now (down, tried): another resolving replica may
    # load it; with none, the router's 503 (retry), not a replica's 404.
    every = [resolving, other, plain]
    assert (serving("x", every, every), serving("x", [other, plain], every)) == ([resolving], [other])
    assert serving("x", [plain], every) == []
    assert serving("y", [other, plain], every) == [other] and serving("y", [plain], every) == [plain]


async def test_a_models_read_keeps_a_name_resolved_after_it_began(replicas) -> None:
    """``router/health.py``: a ``/v1/models`` read that began before a resolving replica's answer may
    not list the adapter it loaded for it: the name stays listed and the list is read again; one that
    began after the answer is the replica's word (an adapter gone is dropped)."""
    _, _, other = replicas
    replicas_ = Replicas()
    replica, _ = replicas_.add(other.url)
    checker = HealthChecker(replicas_, UpstreamClient(5.0, 5.0), RouterMetrics(), 5.0)
    replica.lora_resolved = {"later": float("inf"), "gone": float("-inf")}
    assert await checker.probe(replica)
    assert "later" in replica.models and "gone" not in replica.models
    assert (replica.lora_resolved, replica.models_read_at) == ({"later": float("inf")}, float("-inf"))
    replica.lora_resolved = {}
    assert await checker.probe(replica)
    assert "later" not in replica.models and replica.models_read_at > float("-inf")


async def test_first_requests_for_an_unlisted_name_go_to_one_resolving_replica(cluster, replicas) -> None:
    """Two replicas that resolve the name: requests sent together before either lists it go where
    the first went (round_robin would split them, and both would load it), and the next ones too
    (listed there at once, not at the next ``/v1/models`` read)."""
    _, without, other = replicas
    router = cluster.router("--replica", without.url, "--replica", other.url, "--policy", "round_robin")
    assert wait_until(lambda: all(r["routable"] for r in replicas_view(router).values()), 30)
    body = {"model": "both1", "prompt": "hello", "max_tokens": 2}
    async with httpx.AsyncClient(timeout=60) as client:
        answers = await asyncio.gather(
            *(client.post(router.url + "/v1/completions", json=body) for _ in range(6))
        )
    assert [a.status_code for a in answers] == [200] * 6, [a.text for a in answers]
    served = {r.url: _served(router, r) for r in (without, other)}
    assert sorted(served.values()) == [0, 6]
    home, away = (without, other) if served[without.url] else (other, without)
    _send(router, "both1", 4)  # at once: round_robin's next pick would be the other replica
    assert (_served(router, home), _served(router, away)) == (10, 0)
    listed = {r.url: {m["id"] for m in httpx.get(r.url + "/v1/models").json()["data"]} for r in (home, away)}
    assert ("both1" in listed[home.url], "both1" in listed[away.url]) == (True, False)  # loaded once
    # A name only one of them holds: the other's 404 sends it on, whichever round_robin picks first
    # (of two names in a row, one at least is first sent to the replica without it).
    for name in ("only_other", "only_other2"):
        _send(router, name, 1)
    assert metric(router.url, "ferry:router_requests_total", {"replica": without.url, "status": "404"}) >= 1
    assert metric(router.url, "ferry:router_requests_total", {"replica": other.url, "status": "200"}) >= 2
    # In neither directory: every resolving replica's 404, then that 404 for the client.
    r = httpx.post(router.url + "/v1/completions", json={**body, "model": "nowhere"}, timeout=60)
    assert (r.status_code, r.json()["error"]["code"]) == (404, "model_not_found")


def test_pd_resolves_an_unlisted_adapter_on_both_workers(cluster, replicas, resolver_dir, other_dir) -> None:
    """Prefill/decode disaggregation of a name no replica lists: the first request is served whole by
    the decode worker, which loads the adapter (a decode worker without it would answer 404 after
    the client had the prefill's first token); the next ones are disaggregated, the prefill worker
    loading it from its own directory (the same files) and the decode worker loading the prompt
    blocks it computed with it. Every answer's tokens equal a replica's that serves the adapter
    from ``--lora-modules``. A name one worker's directory lacks is served whole, or a clean 404."""
    with_a, without, other = replicas
    router = cluster.router(
        "--model", str(cluster.model), "--prefill", without.url, "--decode", other.url, "--pd-threshold", "16"
    )
    assert wait_until(lambda: all(r["routable"] for r in replicas_view(router).values()), 30)
    words = " ".join(f"word{i}" for i in range(40))
    common = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    chat = {"messages": [{"role": "user", "content": words}], **common}
    cases = [
        ("/v1/completions", {"prompt": "Resolved twice: " + words, "stream": True, **common}),
        ("/v1/completions", {"prompt": "Resolved twice, again: " + words, **common}),
        ("/v1/chat/completions", {**chat, "stream": True}),
    ]
    hits = metric(other.url, "ferry:kv_tier_hits_total")
    blocks = 0
    for i, (path, body) in enumerate(cases):
        ids, usage = _answer(router.url + path, {**body, "model": "both2"})
        assert ids == _answer(with_a.url + path, {**body, "model": "a"})[0]
        assert len(ids) == 6 and ids != _answer(with_a.url + path, {**body, "model": _base(with_a)})[0]
        blocks += usage["prompt_tokens"] // 16 if i else 0
    pd_paths = {p: metric(router.url, "ferry:router_pd_requests_total", {"path": p}) for p in PD_PATHS}
    assert pd_paths == {"disaggregated": 2, "local_prefill": 1, "mixed": 0}
    # Prompts new to the decode worker: it loaded every block the prefill worker computed.
    assert metric(other.url, "ferry:kv_tier_hits_total") - hits == blocks
    for proc, root in ((without, resolver_dir), (other, other_dir)):
        cards = {m["id"]: m for m in httpx.get(proc.url + "/v1/models").json()["data"]}
        assert cards["both2"]["root"] == str(root.resolve() / "both2")
    # Only the decode worker holds it: the first request resolves it there, the next has the prefill
    # worker's 404 and is served whole there too.
    for _ in range(2):
        ids, _ = _answer(router.url + "/v1/chat/completions", {**chat, "model": "pd_only_other"})
        assert ids == _answer(other.url + "/v1/chat/completions", {**chat, "model": "pd_only_other"})[0]
    # Only the prefill worker holds it: the decode worker's 404, streamed or not, before any token.
    for stream in (True, False):
        r = httpx.post(
            router.url + "/v1/chat/completions", json={**chat, "model": "only_without", "stream": stream}
        )
        assert (r.status_code, r.json()["error"]["code"]) == (404, "model_not_found")
    reasons = {
        r: metric(router.url, "ferry:router_pd_local_prefill_total", {"reason": r}) for r in MODEL_REASONS
    }
    assert reasons == {"model_not_on_decode": 4, "model_not_on_prefill": 1}
    assert metric(router.url, "ferry:router_pd_requests_total", {"path": "disaggregated"}) == 2
    # Once the router has read both workers' lists (five probe intervals): each serves "both2" from
    # its own directory (cards ``lora_resolved``), which is no conflict and nothing to adopt, so
    # both still take it (a decode worker taken off it would leave no worker to continue it).
    time.sleep(1.0)
    view = httpx.get(router.url + "/admin/replicas").json()
    assert [r["lora_pending"]["mismatched"] for r in view["replicas"]] == [[], []]
    assert "both2" not in view["lora"]["adapters"] and "both2" not in view["lora"]["conflicts"]
    path, body = cases[2]
    body = {**body, "messages": [{"role": "user", "content": "Once more: " + words}]}
    assert (
        _answer(router.url + path, {**body, "model": "both2"})[0]
        == _answer(with_a.url + path, {**body, "model": "a"})[0]
    )
    assert metric(router.url, "ferry:router_pd_requests_total", {"path": "disaggregated"}) == 3


PD_PATHS = ("disaggregated", "local_prefill", "mixed")
MODEL_REASONS = ("model_not_on_decode", "model_not_on_prefill")


def _base(replica) -> str:
    return httpx.get(replica.url + "/v1/models").json()["data"][0]["id"]


def _answer(url: str, body: dict) -> tuple[list[int], dict]:
    """(token ids, usage) of a completion or chat answer, streamed or not."""
    if not body.get("stream"):
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"], r.json()["usage"]
    ids: list[int] = []
    usage: dict = {}
    body = {**body, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                obj = json.loads(line[6:])
                assert "error" not in obj, obj
                usage = obj.get("usage") or usage
                for choice in obj.get("choices", []):
                    ids += choice.get("token_ids") or []
    return ids, usage
