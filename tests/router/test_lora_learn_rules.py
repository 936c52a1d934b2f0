"""The rules by which a router learns LoRA adapters from its replicas' ``/v1/models``
(router/lora_learn.py), on the lists a replica answers, in turns a live test cannot place: a read
that overlapped the router's own load is not taken for another party's unload, a change the
router did not send is followed, after a send whose outcome is unknown the next read is a fresh
start rather than a change, an adapter adopted at a first read is owed to the replicas lacking it
(one seen being loaded is not) and taken back from them at an unload, and an unloaded name is
forgotten once no replica has held it for ``TOMBSTONE_KEEP_S``."""

from __future__ import annotations

from router.app import RouterApp
from router.config import RouterConfig
from router.lora_tombstones import SWEEP_S, TOMBSTONE_KEEP_S
from router.replica import Health

URL = "http://127.0.0.1:7301"
URL2 = "http://127.0.0.1:7302"
BASE = {"id": "m", "root": "/models/m", "parent": None}


def _card(name: str, path: str, preloaded: bool = False) -> dict:
    return {"id": name, "root": path, "parent": "m", "lora_preloaded": preloaded}


def _app(*urls: str) -> RouterApp:
    return RouterApp(RouterConfig(replicas=urls or (URL,)))


def _read(app: RouterApp, replica, *cards: dict) -> None:
    """A read of ``replica``'s list that began and ended with no send of the router's in between."""
    app.lora.learn.observe(replica, [BASE, *cards], replica.lora_changes)


def test_a_read_that_overlapped_the_routers_own_load_is_no_unload() -> None:
    app = _app()
    learn, (r,) = app.lora.learn, list(app.replicas)
    _read(app, r)  # the first read: nothing served
    began = r.lora_changes  # a read begins, then the router loads "x" onto the replica ...
    with learn.sending(r):
        pass
    learn.loaded("x", "/a/x")
    learn.sent(r, "x", "/a/x", 200)
    learn.observe(r, [BASE], began)  # ... and the read, answered before the load, ends after it
    assert app.lora.adapters == {"x": "/a/x"} and learn.tombstones.names() == []
    _read(app, r)  # read again, with nothing in between: it is gone, unloaded by someone else
    assert app.lora.adapters == {} and learn.tombstones.names() == ["x"]
    assert learn.view() == {"adapters": {}, "unloaded": ["x"], "conflicts": {}}


def test_another_partys_load_and_replacement_are_followed() -> None:
    app = _app()
    learn, (r,) = app.lora.learn, list(app.replicas)
    learn.loaded("x", "/a/x")  # loaded through this router ...
    _read(app, r, _card("x", "/a/x"))
    _read(app, r, _card("x", "/b/x"))  # ... then replaced on the replica by another router
    assert learn.view()["adapters"] == {"x": {"path": "/b/x", "origin": "adopted"}}
    learn.unloaded_here("y")
    _read(app, r, _card("x", "/b/x"), _card("y", "/a/y"))  # y loaded elsewhere after this unload
    assert app.lora.adapters == {"x": "/b/x", "y": "/a/y"} and learn.tombstones.names() == []
    assert r.lora_mismatch == set()


def test_after_a_send_of_unknown_outcome_the_next_read_is_a_fresh_start() -> None:
    app = _app()
    learn, (r,) = app.lora.learn, list(app.replicas)
    learn.loaded("x", "/a/x")
    _read(app, r, _card("x", "/a/x"))
    with learn.sending(r):
        pass
    learn.sent(r, "x", None, 502)  # an unload it may or may not have done
    r.lora_unloads.add("x")
    learn.unloaded_here("x")
    assert r.lora_seen is None
    _read(app, r, _card("x", "/a/x"))  # still listed: owed the unload, not adopted back
    assert app.lora.adapters == {} and learn.tombstones.names() == ["x"]
    assert r.lora_seen == {"x": "/a/x"}


def test_a_conflict_keeps_requests_off_the_mismatched_replica_until_they_agree() -> None:
    app = _app(URL, "http://127.0.0.1:7302")
    learn = app.lora.learn
    first, second = list(app.replicas)
    _read(app, first, _card("x", "/a/x"))
    assert learn.view()["adapters"] == {"x": {"path": "/a/x", "origin": "adopted"}}
    _read(app, second, _card("x", "/b/x", preloaded=True))
    assert learn.view() == {
        "adapters": {},
        "unloaded": [],
        "conflicts": {"x": {first.url: "/a/x", second.url: "/b/x"}},
    }
    assert (first.lora_mismatch, second.lora_mismatch) == (set(), {"x"})
    assert app.metrics.lora_failures.labels("adopt")._value.get() == 1
    _read(app, first)  # the adapter at the path the router knew is gone: no conflict left
    assert learn.view() == {"adapters": {}, "unloaded": [], "conflicts": {}}
    _read(app, second, _card("x", "/b/x", preloaded=True))  # served from --lora-modules: not adopted
    assert app.lora.adapters == {} and second.lora_mismatch == set()


def test_an_adopted_adapter_is_owed_to_replicas_lacking_it_and_taken_back_at_an_unload() -> None:
    app = _app(URL, URL2)
    learn = app.lora.learn
    first, second = list(app.replicas)
    _read(app, second)
    assert app.lora.pending(second)["restore"] == []
    _read(app, first, _card("x", "/a/x"))  # adopted from first: second, lacking it, is owed it
    assert learn.view()["adapters"] == {"x": {"path": "/a/x", "origin": "adopted"}}
    assert app.lora.pending(second)["restore"] == ["x"]
    learn.place(second, "x")  # the restore loaded it there
    _read(app, second, _card("x", "/a/x"))
    _read(app, first)  # then another router unloaded it: second gets the unload too
    assert learn.view() == {"adapters": {}, "unloaded": ["x"], "conflicts": {}}
    assert second.lora_unloads == {"x"} and first.lora_unloads == set()
    assert app.lora.pending(second)["unloads"] == ["x"]

    second.lora_unloads.clear()  # that unload done
    _read(app, second)
    _read(app, first, _card("x", "/a/x"))  # loaded again while it ran: followed, not spread
    assert learn.view()["adapters"] == {"x": {"path": "/a/x", "origin": "adopted"}}
    assert not learn.owes(second, "x")
    assert learn.placed == {}


def test_an_unloaded_name_is_forgotten_once_no_replica_has_held_it_for_a_while() -> None:
    now = [0.0]
    app = RouterApp(RouterConfig(replicas=(URL, URL2)), clock=lambda: now[0])
    learn = app.lora.learn
    first, second = list(app.replicas)
    _read(app, first)
    _read(app, second, _card("x", "/a/x"))
    learn.unloaded_here("x")
    second.lora_unloads.add("x")  # second missed the unload: it may hold x still
    for now[0] in (SWEEP_S, TOMBSTONE_KEEP_S + 2 * SWEEP_S):
        _read(app, first)
        assert learn.tombstones.names() == ["x"]

    second.lora_unloads.clear()  # its unload done: from now on no replica holds x
    begin = now[0] = TOMBSTONE_KEEP_S + 3 * SWEEP_S
    _read(app, second)
    # A healthy replica not read since it restarted may hold it: the wait starts again after it.
    now[0] = begin + SWEEP_S
    second.health = Health.HEALTHY
    learn.restarted(second)
    _read(app, first)
    begin = now[0] = begin + 2 * SWEEP_S
    _read(app, second)
    now[0] = begin + TOMBSTONE_KEEP_S - 1
    _read(app, first)
    assert learn.tombstones.names() == ["x"]
    now[0] = begin + TOMBSTONE_KEEP_S + SWEEP_S
    _read(app, first)
    assert learn.view() == {"adapters": {}, "unloaded": [], "conflicts": {}}
