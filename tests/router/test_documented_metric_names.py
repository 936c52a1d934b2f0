"""Every Prometheus metric README.md, router/README.md and ARCHITECTURE.md name is exported by a live
`ferry serve` replica or `ferry router` (deploy/README.md's are checked in tests/deploy), so a metric
renamed in code cannot live on in the docs an operator builds dashboards from.

The replica runs with the features whose metrics exist only when they are on: a KV tier, a LoRA
adapter and n-gram speculative decoding."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from router_harness import Cluster

from engine.demo import build_lora_adapter

REPO = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "router/README.md", "ARCHITECTURE.md")
PREFIXES = ("vllm:", "ferry:")
SERIES_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created")}


def expand(name: str) -> list[str]:
    """`vllm:request_{prefill,decode}_time_seconds` is two names."""
    group = re.search(r"\{([^{}]*)\}", name)
    if group is None:
        return [name]
    head, tail = name[: group.start()], name[group.end() :]
    return [n for alt in group.group(1).split(",") for n in expand(head + alt + tail)]


def documented() -> tuple[dict[str, set[str]], set[str]]:
    """Metric name -> docs naming it, and the prefixes docs name with a `*` (`ferry:router_*`).
    Redis keys (`ferry:kv:{…}:{…}`, `ferry:replica:*`) are not metrics and are left out."""
    names: dict[str, set[str]] = {}
    prefixes: set[str] = set()
    for doc in DOCS:
        for token in re.findall(r"`((?:vllm|ferry):[^`\s]+)`", (REPO / doc).read_text()):
            bare = re.sub(r"\{[^{}]*\}$", "", token)  # the label set a series is written with
            if m := re.fullmatch(r"((?:vllm|ferry):[a-z0-9_]+_)\*", bare):
                prefixes.add(m.group(1))
                continue
            for name in expand(bare):
                if re.fullmatch(r"(?:vllm|ferry):[a-z0-9_]+", name):
                    names.setdefault(name, set()).add(doc)
    return names, prefixes


def exported_names(exposition: str) -> set[str]:
    """Every series name a scrape of this text can hold, declared families without samples included."""
    names: set[str] = set()
    for family in text_string_to_metric_families(exposition):
        names.add(family.name)
        names.update(family.name + s for s in SERIES_SUFFIXES.get(family.type, ()))
        names.update(s.name for s in family.samples)
    return names


@pytest.fixture(scope="module")
def scrapes(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    tmp = tmp_path_factory.mktemp("documented-metrics")
    adapter = build_lora_adapter(tmp / "sql", tiny_llama, seed=1)
    cluster = Cluster(tiny_llama, tmp)
    try:
        spec = json.dumps({"method": "ngram", "num_speculative_tokens": 2})
        (replica,) = cluster.replicas(
            1,
            "--kv-tier",
            "memory://",
            "--enable-lora",
            "--lora-modules",
            f"sql={adapter}",
            "--speculative-config",
            spec,
        )
        router = cluster.router("--replica", replica.url)
        # One request through the router (and one with the adapter), so labelled series have samples.
        for model in (tiny_llama.name, "sql"):
            body = {"model": model, "prompt": "a b a b a b a", "max_tokens": 4, "temperature": 0}
            answer = httpx.post(router.url + "/v1/completions", json=body, timeout=120)
            assert answer.status_code == 200, answer.text
        yield (
            httpx.get(replica.url + "/metrics", timeout=10).text,
            httpx.get(router.url + "/metrics", timeout=10).text,
        )
    finally:
        cluster.close()


def test_documented_metrics_are_exported(scrapes: tuple[str, str]) -> None:
    replica_text, router_text = scrapes
    exported = exported_names(replica_text) | exported_names(router_text)
    names, prefixes = documented()
    # What this test was written against must still be read from the docs.
    assert {
        "vllm:request_success_total",
        "ferry:router_failovers_total",
        "vllm:request_decode_time_seconds",
    } <= set(names)
    assert {"ferry:router_", "ferry:kv_tier_", "vllm:spec_decode_"} <= prefixes
    missing = {name: sorted(docs) for name, docs in names.items() if name not in exported}
    assert not missing, f"named in the docs, exported by neither replica nor router: {missing}"
    for prefix in prefixes:
        assert any(n.startswith(prefix) for n in exported), f"no exported metric starts with {prefix}"


def test_router_metrics_come_from_the_router(scrapes: tuple[str, str]) -> None:
    """`/metrics` of the router exposes `ferry:router_*` (README), and a replica none of them."""
    replica_text, router_text = scrapes
    names, _ = documented()
    router_side = {n for n in names if n.startswith("ferry:router_")}
    assert router_side and router_side <= exported_names(router_text)
    assert not {n for n in exported_names(replica_text) if n.startswith("ferry:router_")}
