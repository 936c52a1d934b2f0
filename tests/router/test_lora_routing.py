"""LoRA adapters behind `ferry router`: a request for an adapter goes only to the replicas that list
it (read again from their ``/v1/models`` as adapters come and go), and the router keys an adapter's
prompts with the block hashes its replica gives them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from router_harness import Cluster, metric, replicas_view, wait_until

from engine.demo import build_lora_adapter
from kvcache.keys import to_hex
from router.health import HealthChecker
from router.metrics import RouterMetrics
from router.pool import Replicas
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


@pytest.fixture(scope="module")
def setup(cluster: Cluster, adapter: Path, resolver_dir: Path) -> Iterator[tuple]:
    (with_a,) = cluster.replicas(
        1, "--enable-lora", "--lora-modules", f"a={adapter}", "--kv-tier", "memory://"
    )
    (without,) = cluster.replicas(
        1, "--enable-lora", "--allow-runtime-lora-updating", "--lora-resolver-dir", str(resolver_dir)
    )
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
    assert hashes["a"] != next(v for k, v in hashes.items() if k != "a")


def test_a_resolving_replicas_answer_has_its_models_read_at_the_next_probe() -> None:
    """The relay's hand-off to the prober (``router/relay.py``): a resolving replica's 2xx for a
    name it did not list makes its ``/v1/models`` stale, so the probe after it reads the list
    (``MODELS_REFRESH_S`` would otherwise keep the adapter unknown for up to 5 s). Exact in a way
    the live test cannot time."""
    from router.relay import _learn_resolved

    replicas = Replicas()
    resolving, _ = replicas.add("http://127.0.0.1:7401")
    plain, _ = replicas.add("http://127.0.0.1:7402")
    resolving.lora_resolver = True
    for r in (resolving, plain):
        r.models, r.models_read_at = ["m", "a"], 100.0
    _learn_resolved(plain, "x", 200)  # no resolver: nothing to learn
    _learn_resolved(resolving, "a", 200)  # listed already
    _learn_resolved(resolving, "x", 404)  # not found there
    _learn_resolved(resolving, None, 200)  # no model named
    assert (resolving.models_read_at, plain.models_read_at) == (100.0, 100.0)
    _learn_resolved(resolving, "x", 200)
    assert resolving.models_read_at == float("-inf")
