"""A router learns the LoRA adapters its replicas already serve (router/lora_learn.py): a router
started after another one loaded an adapter adopts it, loads it onto the replicas it has that lack
it, and restores it onto a replica that joins; one name under two paths is not adopted and its
mismatched replica gets no request for it; an unload is the last word (no router adopts or restores
the adapter again, a load of it that crossed the unload is taken back, and the names unloaded stay
a bounded set); and two routers in front of the same replicas follow each other's loads and unloads
instead of undoing them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from router_harness import Cluster, Proc, metric, replicas_view, wait_until

from engine.demo import build_lora_adapter
from router.lora_tombstones import TOMBSTONES_MAX

LORA_FLAGS = ("--enable-lora", "--allow-runtime-lora-updating")
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
FAILURES = "ferry:router_lora_failures_total"
POOL = 4  # the most replicas a test here uses


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_llama: Path) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("adopt")
    one = build_lora_adapter(root / "one", tiny_llama, seed=11, alpha=32)
    two = build_lora_adapter(root / "two", tiny_llama, seed=12, alpha=32)
    return str(one), str(two)


@pytest.fixture(scope="module")
def pool(cluster: Cluster) -> list[Proc]:
    """Replicas started once for the module (a replica start is most of each test's time)."""
    return cluster.replicas(POOL, *LORA_FLAGS)


@pytest.fixture
def fresh(cluster: Cluster, pool: list[Proc]) -> Iterator[Callable[[int], list[Proc]]]:
    """``fresh(n)``: ``n`` replicas that serve no adapter and that no router knows, as if just
    started (each of the pool's at most once per test). After the test its routers (and any process
    it started) are stopped first, so that none restores an adapter, then every pool replica's
    adapters are unloaded."""
    started, taken = len(cluster.procs), 0

    def take(n: int) -> list[Proc]:
        nonlocal taken
        assert taken + n <= len(pool), "the pool is too small for this test"
        out, taken = pool[taken : taken + n], taken + n
        assert all(_cards(p) == {} for p in out)
        return out

    yield take
    for proc in reversed(cluster.procs[started:]):
        proc.stop()
    del cluster.procs[started:]
    for replica in pool:
        for name in _cards(replica):
            assert _post(replica.url, UNLOAD, {"lora_name": name}).status_code == 200


def _lora(router: Proc) -> dict:
    return httpx.get(router.url + "/admin/replicas", timeout=5).json()["lora"]


def _cards(replica: Proc) -> dict[str, str]:
    """The adapters a replica serves: name -> path."""
    data = httpx.get(replica.url + "/v1/models", timeout=5).json()["data"]
    return {m["id"]: m["root"] for m in data if m["parent"] is not None}


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def _add(router: Proc, replica: Proc) -> None:
    r = httpx.post(router.url + "/admin/replicas", json={"url": replica.url}, timeout=30)
    assert r.status_code == 201, r.text
    assert wait_until(lambda: replicas_view(router)[replica.url]["routable"], 30)


def _served(router: Proc, replicas: list[Proc], model: str, n: int) -> dict[str, float]:
    """Send ``n`` requests for ``model``: how many each replica served."""
    before = {p.url: metric(router.url, "ferry:router_requests_total", {"replica": p.url}) for p in replicas}
    for _ in range(n):
        r = _post(router.url, "/v1/completions", {"model": model, "prompt": "hello", "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
    after = {p.url: metric(router.url, "ferry:router_requests_total", {"replica": p.url}) for p in replicas}
    return {url: after[url] - before[url] for url in after}


def test_a_new_router_restores_what_the_old_one_loaded_and_an_unload_stays(
    cluster: Cluster, fresh: Callable[[int], list[Proc]], adapters: tuple[str, str]
) -> None:
    one, _ = adapters
    first, second = fresh(2)
    old = cluster.router("--replica", first.url, "--replica", second.url, all_routable=True)
    assert _post(old.url, LOAD, {"lora_name": "kept", "lora_path": one}).status_code == 200
    old.stop()

    router = cluster.router(
        "--replica", first.url, "--replica", second.url, "--policy", "round_robin", all_routable=True
    )
    assert wait_until(lambda: _lora(router)["adapters"], 30)
    assert _lora(router) == {
        "adapters": {"kept": {"path": one, "origin": "adopted"}},
        "unloaded": [],
        "conflicts": {},
    }
    (late,) = fresh(1)
    assert _cards(late) == {}
    _add(router, late)  # routable once its restore is done
    assert _cards(late) == {"kept": one}
    everyone = [first, second, late]
    assert wait_until(lambda: all("kept" in v["models"] for v in replicas_view(router).values()), 30)
    assert _served(router, everyone, "kept", 3) == {p.url: 1 for p in everyone}
    assert metric(router.url, FAILURES, {"op": "restore"}) == 0

    # Unloaded through the new router: gone everywhere, and not adopted again from a replica that
    # joins with it (loaded onto it directly, as by a router that did not hear of the unload).
    gone = _post(router.url, UNLOAD, {"lora_name": "kept"})
    assert gone.status_code == 200, gone.text
    assert gone.json()["replicas"] == {p.url: 200 for p in everyone}
    assert all(_cards(p) == {} for p in everyone)
    (stale,) = fresh(1)
    assert _post(stale.url, LOAD, {"lora_name": "kept", "lora_path": one}).status_code == 200
    _add(router, stale)
    assert wait_until(lambda: "kept" in replicas_view(router)[stale.url]["models"], 30)
    assert _lora(router) == {"adapters": {}, "unloaded": ["kept"], "conflicts": {}}
    assert all(_cards(p) == {} for p in everyone)


def test_one_name_under_two_paths_is_not_adopted(
    cluster: Cluster, fresh: Callable[[int], list[Proc]], adapters: tuple[str, str]
) -> None:
    one, two = adapters
    (first,) = fresh(1)
    assert _post(first.url, LOAD, {"lora_name": "twin", "lora_path": one}).status_code == 200
    router = cluster.router("--replica", first.url, "--policy", "round_robin", all_routable=True)
    assert wait_until(lambda: _lora(router)["adapters"], 30)
    assert _lora(router)["adapters"] == {"twin": {"path": one, "origin": "adopted"}}

    (other,) = fresh(1)
    assert _post(other.url, LOAD, {"lora_name": "twin", "lora_path": two}).status_code == 200
    _add(router, other)
    assert _lora(router) == {
        "adapters": {},
        "unloaded": [],
        "conflicts": {"twin": {first.url: one, other.url: two}},
    }
    assert metric(router.url, FAILURES, {"op": "adopt"}) == 1
    assert _cards(other) == {"twin": two}  # the router did not load its path over the replica's
    view = replicas_view(router)
    assert view[other.url]["lora_pending"]["mismatched"] == ["twin"]
    assert view[first.url]["lora_pending"]["mismatched"] == []
    # Requests for it go where it has the path the router knew it by (both replicas take requests).
    assert view[first.url]["routable"] and view[other.url]["routable"]
    assert _served(router, [first, other], "twin", 4) == {first.url: 4, other.url: 0}
    # Not adopted: a replica that joins is not given it.
    (late,) = fresh(1)
    _add(router, late)
    assert _cards(late) == {}
    assert metric(router.url, FAILURES, {"op": "adopt"}) == 1  # counted once, not at every read


def test_two_routers_follow_each_others_loads_and_unloads(
    cluster: Cluster, fresh: Callable[[int], list[Proc]], adapters: tuple[str, str]
) -> None:
    one, two = adapters
    replicas = fresh(2)
    args = [a for p in replicas for a in ("--replica", p.url)]
    a = cluster.router(*args, all_routable=True)
    b = cluster.router(*args, all_routable=True)
    assert _post(a.url, LOAD, {"lora_name": "both", "lora_path": one}).status_code == 200
    # b sees it appear on replicas it was already reading: another router's load, adopted.
    assert wait_until(lambda: _lora(b)["adapters"] == {"both": {"path": one, "origin": "adopted"}}, 30)
    replace = {"lora_name": "both", "lora_path": two, "load_inplace": True}
    assert _post(b.url, LOAD, replace).status_code == 200
    assert _lora(b)["adapters"] == {"both": {"path": two, "origin": "loaded"}}
    # a follows b's new path rather than loading its own back.
    assert wait_until(lambda: _lora(a)["adapters"] == {"both": {"path": two, "origin": "adopted"}}, 30)

    gone = _post(b.url, UNLOAD, {"lora_name": "both"})
    assert gone.status_code == 200, gone.text
    assert wait_until(lambda: _lora(a)["adapters"] == {}, 30)
    assert _lora(a) == {"adapters": {}, "unloaded": ["both"], "conflicts": {}}
    # A replica that joins a afterwards is not given the adapter b unloaded.
    (late,) = fresh(1)
    _add(a, late)
    assert _cards(late) == {}
    assert all(_cards(p) == {} for p in replicas)
    assert metric(a.url, FAILURES, {"op": "restore"}) == 0
    assert metric(b.url, FAILURES, {"op": "restore"}) == 0


def test_adapters_a_replica_was_started_with_are_not_adopted(
    cluster: Cluster, fresh: Callable[[int], list[Proc]], adapters: tuple[str, str]
) -> None:
    one, _ = adapters
    (flagged,) = cluster.replicas(1, *LORA_FLAGS, "--lora-modules", f"pre={one}")
    router = cluster.router("--replica", flagged.url, all_routable=True)
    assert wait_until(lambda: "pre" in replicas_view(router)[flagged.url]["models"], 30)
    # They come with the flag: one started without it is not given them.
    assert _lora(router) == {"adapters": {}, "unloaded": [], "conflicts": {}}
    (late,) = fresh(1)
    _add(router, late)
    assert _cards(late) == {}
    assert _served(router, [flagged, late], "pre", 2) == {flagged.url: 2, late.url: 0}


def test_an_adopted_adapter_is_loaded_onto_the_replicas_lacking_it(
    cluster: Cluster, fresh: Callable[[int], list[Proc]], adapters: tuple[str, str]
) -> None:
    one, _ = adapters
    holder, lacking, late = fresh(3)  # late: added to the router at the end
    # Loaded onto one replica by a router now gone (straight onto it here), missed by the other.
    assert _post(holder.url, LOAD, {"lora_name": "spread", "lora_path": one}).status_code == 200
    router = cluster.router(
        "--replica", holder.url, "--replica", lacking.url, "--policy", "round_robin", all_routable=True
    )
    assert wait_until(lambda: _cards(lacking) == {"spread": one}, 20)
    assert _lora(router) == {
        "adapters": {"spread": {"path": one, "origin": "adopted"}},
        "unloaded": [],
        "conflicts": {},
    }
    assert wait_until(lambda: all("spread" in v["models"] for v in replicas_view(router).values()), 30)
    assert _served(router, [holder, lacking], "spread", 2) == {holder.url: 1, lacking.url: 1}
    assert metric(router.url, FAILURES, {"op": "restore"}) == 0

    # Unloaded from the replica it was adopted from (as by another router whose unload crossed this
    # router's load onto the other one): the load is taken back, the unload wins.
    assert _post(holder.url, UNLOAD, {"lora_name": "spread"}).status_code == 200
    assert wait_until(lambda: _cards(lacking) == {}, 20)
    assert _lora(router) == {"adapters": {}, "unloaded": ["spread"], "conflicts": {}}

    # Loaded again there, then unloaded just before a replica joins: the joining replica's restore
    # reads the replica it was adopted from first, sees it gone and loads nothing.
    assert _post(holder.url, LOAD, {"lora_name": "spread", "lora_path": one}).status_code == 200
    assert wait_until(lambda: _lora(router)["adapters"] == {"spread": {"path": one, "origin": "adopted"}}, 20)
    assert _post(holder.url, UNLOAD, {"lora_name": "spread"}).status_code == 200
    _add(router, late)
    assert _cards(late) == {}
    assert _lora(router) == {"adapters": {}, "unloaded": ["spread"], "conflicts": {}}
    assert all(_cards(p) == {} for p in (holder, lacking, late))
    assert metric(router.url, FAILURES, {"op": "restore"}) == 0


def test_unloaded_names_are_a_bounded_set_that_keeps_those_a_replica_still_holds(
    cluster: Cluster, fresh: Callable[[int], list[Proc]], adapters: tuple[str, str]
) -> None:
    one, _ = adapters
    first, stale = fresh(2)
    router = cluster.router("--replica", first.url, all_routable=True)
    assert _post(router.url, UNLOAD, {"lora_name": "held"}).status_code == 404  # no replica had it
    # A replica that missed the unload joins holding it: not adopted, and it keeps the name unloaded.
    assert _post(stale.url, LOAD, {"lora_name": "held", "lora_path": one}).status_code == 200
    _add(router, stale)
    assert wait_until(lambda: "held" in replicas_view(router)[stale.url]["models"], 30)
    names = [f"gone-{i:03d}" for i in range(TOMBSTONES_MAX)]
    assert _post(router.url, UNLOAD, {"lora_name": names[0]}).status_code == 404
    with ThreadPoolExecutor(8) as pool:  # the rest in any order: they are newer than names[0]
        statuses = list(
            pool.map(lambda n: _post(router.url, UNLOAD, {"lora_name": n}).status_code, names[1:])
        )
    assert statuses == [404] * (TOMBSTONES_MAX - 1)
    # One name too many: the oldest that no replica holds is forgotten, not "held", older still.
    assert _lora(router) == {"adapters": {}, "unloaded": [*names[1:], "held"], "conflicts": {}}
    assert _cards(stale) == {"held": one} and _cards(first) == {}
