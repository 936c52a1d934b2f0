"""cache_aware forgets what a replica held once its KV cache is gone: a restart (its /health names a
new ``instance_id``), a prefix-cache reset (``prefix_cache_resets`` grows, whether the reset came
through the router or straight to the replica), and, for a server that names neither, a return
after being ejected. Otherwise the router would keep sending a prompt's followers to a replica it
believes holds the prompt, which computes it all again.

What the router predicts is read from ``ferry:router_cache_hit_tokens_total`` (prompt tokens the
chosen replica should hold, summed over requests).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from router_harness import Cluster, Proc, free_port, metric, replica_args, replicas_view, wait_until
from scripted_replica import ScriptedReplica

PROMPT = "The quick brown fox jumps over the lazy dog. " * 8  # several 16-token blocks
HITS = "ferry:router_cache_hit_tokens_total"


@pytest.fixture(scope="module")
def restartable(cluster: Cluster) -> Iterator[tuple[Proc, Proc]]:
    """One replica on a port it can be started on again, behind a cache_aware router."""
    port = free_port()
    (replica,) = cluster.replicas(1, ports=[port])
    router = cluster.router(
        "--replica", replica.url, "--policy", "cache_aware", "--model", str(cluster.model)
    )
    assert wait_until(lambda: replicas_view(router)[replica.url]["routable"])
    yield replica, router


def _complete(router: Proc, prompt: str = PROMPT) -> dict:
    r = httpx.post(router.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _predicted(router: Proc, prompt: str = PROMPT) -> float:
    """The prompt tokens the router predicted its replica holds for one request of ``prompt``."""
    return _sent(router, prompt)[0]


def _sent(router: Proc, prompt: str = PROMPT) -> tuple[float, dict]:
    """One request of ``prompt``: the prompt tokens the router predicted its replica holds, and
    the answer."""
    before = metric(router.url, HITS)
    answer = _complete(router, prompt)
    return metric(router.url, HITS) - before, answer


def _learned(router: Proc, prompt: str = PROMPT) -> None:
    _complete(router, prompt)
    assert _predicted(router, prompt) >= 64  # the router believes the replica holds the prompt


def test_a_restarted_replica_is_not_believed_to_hold_its_old_prefixes(
    cluster: Cluster, restartable: tuple[Proc, Proc]
) -> None:
    replica, router = restartable
    _learned(router)
    old = httpx.get(replica.url + "/health").json()["instance_id"]
    replica.stop()
    restarted = Proc(replica_args(cluster.model, replica.port), replica.port, replica.log).start()
    cluster.procs.append(restarted)
    restarted.wait_http()
    new = httpx.get(restarted.url + "/health").json()["instance_id"]
    assert new != old
    assert wait_until(
        lambda: (
            replicas_view(router)[replica.url]["instance_id"] == new
            and replicas_view(router)[replica.url]["routable"]
        )
    )
    predicted, answer = _sent(router)
    # ... rightly: the new process computed the whole prompt. The router learns it again from there.
    assert predicted == 0 and answer["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert _predicted(router) >= 64


def test_a_prefix_cache_reset_is_forgotten_too(cluster: Cluster, restartable: tuple[Proc, Proc]) -> None:
    replica, router = restartable  # (the same URL, whichever process now serves it)
    # Straight to the replica (the router learns it from /health's prefix_cache_resets) ...
    prompt = "Another prompt, reset on the replica itself. " * 8
    _learned(router, prompt)
    resets = httpx.get(replica.url + "/health").json()["prefix_cache_resets"]
    assert httpx.post(replica.url + "/reset_prefix_cache", timeout=10).status_code == 200
    assert wait_until(lambda: replicas_view(router)[replica.url]["prefix_cache_resets"] == resets + 1)
    assert _predicted(router, prompt) == 0
    # ... and through the router's fan-out: forgotten at once, not at its next probe (here far off).
    slow = cluster.router(
        "--replica", replica.url, "--policy", "cache_aware", "--model", str(cluster.model),
        "--health-interval", "60",
    )  # fmt: skip
    assert replicas_view(slow)[replica.url]["routable"]  # (probed at its start)
    prompt = "A third prompt, reset through the router. " * 8
    _learned(slow, prompt)
    assert httpx.post(slow.url + "/reset_prefix_cache", timeout=10).status_code == 200
    predicted, answer = _sent(slow, prompt)
    assert predicted == 0 and answer["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert _predicted(slow, prompt) >= 64


def test_a_server_naming_no_instance_is_forgotten_when_it_comes_back(tmp_path: Path) -> None:
    """Another server (no instance_id in its /health) that was ejected may have restarted; one
    that names an instance is forgotten when the name changes, even with no failed probe."""
    other = ScriptedReplica()
    other.whole = {"id": "w", "object": "text_completion", "choices": [{"index": 0, "text": "x"}]}
    cluster = Cluster(tmp_path, tmp_path)
    try:
        router = cluster.router("--replica", other.url, "--policy", "cache_aware")
        assert wait_until(lambda: replicas_view(router)[other.url]["routable"])
        _learned(router)
        other.hung = True  # /health 503 until ejected
        assert wait_until(lambda: replicas_view(router)[other.url]["health"] == "ejected")
        other.hung = False
        assert wait_until(lambda: replicas_view(router)[other.url]["routable"])
        assert _predicted(router) == 0

        other.health_body = {"status": "ok", "instance_id": "a"}
        assert wait_until(lambda: replicas_view(router)[other.url]["instance_id"] == "a")
        _learned(router)
        other.health_body = {"status": "ok", "instance_id": "b"}
        assert wait_until(lambda: replicas_view(router)[other.url]["instance_id"] == "b")
        assert _predicted(router) == 0
    finally:
        cluster.close()
        other.close()
