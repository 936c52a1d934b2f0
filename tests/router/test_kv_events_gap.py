"""The router misses some of a replica's KV events (a Redis outage, a stream trimmed by MAXLEN past
what it had read, a stream recreated, a publisher that could not append): it drops that replica's
prefix-index entries instead of keeping blocks a lost reset removed, counts the gap in
``ferry:router_kv_event_gaps_total{reason}`` and logs it once.

Real Redis servers (the conftest fixtures), real publishers and the router's real follower and
metrics; the follower is polled by hand so each test decides what it reads and when.
"""

from __future__ import annotations

import logging
import time

import pytest
import redis

from kvcache.events import KVEventPublisher, events_stream
from kvcache.keys import block_hashes
from router.kv_events import KVEventFollower
from router.metrics import RouterMetrics
from router.prefix_index import PrefixIndex

A, B = "http://127.0.0.1:9101", "http://127.0.0.1:9102"
FP = "fpgap"
HS = block_hashes(list(range(64)), 16)  # 4 chained blocks of one prompt
NEW = block_hashes(list(range(500, 532)), 16)  # 2 blocks of another prompt


def _follower(url: str, metrics: RouterMetrics) -> KVEventFollower:
    return KVEventFollower(
        url,
        PrefixIndex(100),
        known_url=lambda u: u in (A, B),
        instance_of={A: "a-1", B: "b-1"}.get,  # what their /health names
        counter=metrics.kv_events,
        gap_counter=metrics.kv_event_gaps,
    )


def _contents(index: PrefixIndex) -> dict[bytes, set[str]]:
    """Every entry of the index: block hash -> the replicas it says hold it."""
    index.check_integrity()
    return {h: index.holders(h) for h in HS + NEW if index.holders(h)}


def _gaps(metrics: RouterMetrics) -> dict[str, float | None]:
    get = metrics.registry.get_sample_value
    return {
        r: get("ferry:router_kv_event_gaps_total", {"reason": r})
        for r in ("sequence", "trimmed", "recreated")
    }


def _poll(follower: KVEventFollower) -> int:
    """``poll_once``; a reader whose connection a Redis restart broke reconnects on its next read."""
    for _ in range(3):
        try:
            return follower.poll_once()
        except redis.ConnectionError:
            continue
    return follower.poll_once()


def _gap_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if "never read" in r.getMessage() or "lost entries" in r.getMessage()
    ]


def _publishers(url: str) -> tuple[KVEventPublisher, KVEventPublisher]:
    pub_a = KVEventPublisher(url, FP, replica_id=A, instance_id="a-1")
    pub_b = KVEventPublisher(url, FP, replica_id=B, instance_id="b-1")
    assert pub_a.publish("stored", HS[:3]) and pub_a.publish("stored", HS[:3], medium="tier")
    assert pub_b.publish("stored", HS[:1])
    return pub_a, pub_b


def _following(url: str) -> tuple[RouterMetrics, KVEventPublisher, KVEventPublisher, KVEventFollower]:
    """Replicas A and B that published their blocks, and a follower that has read them."""
    metrics = RouterMetrics()
    pub_a, pub_b = _publishers(url)
    follower = _follower(url, metrics)
    assert follower.poll_once() == 2
    return metrics, pub_a, pub_b, follower


@pytest.mark.parametrize("a_publishes_after", [False, True], ids=["replica-idle", "replica-busy"])
def test_trimmed_stream_drops_the_replicas_it_had_read(
    redis_url: str, caplog: pytest.LogCaptureFixture, a_publishes_after: bool
) -> None:
    metrics, pub_a, pub_b, follower = _following(redis_url)
    assert _contents(follower.index) == {HS[0]: {A, B}, HS[1]: {A}, HS[2]: {A}}
    assert _gaps(metrics) == {"sequence": 0, "trimmed": 0, "recreated": 0}  # tier events numbered too

    # The router cannot read for a while; A resets its cache and MAXLEN trims those events away.
    assert pub_a.publish("removed", HS[:3])
    if a_publishes_after:
        assert pub_a.publish("stored", NEW[:1])
    client = redis.Redis.from_url(redis_url)
    client.xtrim(events_stream(FP), maxlen=1 if a_publishes_after else 0, approximate=False)
    assert client.xlen(events_stream(FP)) == (1 if a_publishes_after else 0)

    caplog.set_level(logging.WARNING, logger="ferry.router")
    assert follower.poll_once() == (1 if a_publishes_after else 0)
    # Both replicas' events came from the stream (whose were trimmed is unknown): both re-learn.
    assert _contents(follower.index) == ({NEW[0]: {A}} if a_publishes_after else {})
    assert _gaps(metrics) == {"sequence": 0, "trimmed": 1, "recreated": 0}  # A's seq jump is the same gap
    assert follower.gaps == {"sequence": 0, "trimmed": 1, "recreated": 0}
    assert len(_gap_lines(caplog)) == 1
    assert A in _gap_lines(caplog)[0] and B in _gap_lines(caplog)[0]

    # The index learns again from events after the gap, and the gap is not counted twice.
    assert pub_b.publish("stored", HS[:2]) and pub_a.publish("stored", NEW[:2])
    assert follower.poll_once() == 2
    assert _contents(follower.index) == {HS[0]: {B}, HS[1]: {B}, NEW[0]: {A}, NEW[1]: {A}}
    assert _gaps(metrics) == {"sequence": 0, "trimmed": 1, "recreated": 0}
    assert len(_gap_lines(caplog)) == 1
    for p in (pub_a, pub_b):
        p.close()


def test_trim_of_events_already_read_is_no_gap(redis_url: str) -> None:
    metrics, pub_a, pub_b, follower = _following(redis_url)
    redis.Redis.from_url(redis_url).xtrim(events_stream(FP), maxlen=0, approximate=False)
    assert pub_a.publish("removed", HS[2:3])
    assert follower.poll_once() == 1
    assert _contents(follower.index) == {HS[0]: {A, B}, HS[1]: {A}}
    assert _gaps(metrics) == {"sequence": 0, "trimmed": 0, "recreated": 0}
    for p in (pub_a, pub_b):
        p.close()


@pytest.mark.parametrize("read_while_gone", [False, True], ids=["recreated", "gone-then-recreated"])
def test_redis_restarted_empty_drops_the_replicas(
    private_redis, caplog: pytest.LogCaptureFixture, read_while_gone: bool
) -> None:
    server = private_redis()
    metrics, pub_a, pub_b, follower = _following(server.url)

    server.stop()  # an outage: A's reset cannot be published, and Redis comes back empty
    assert not pub_a.publish("cleared", [])
    server.start()
    caplog.set_level(logging.WARNING, logger="ferry.router")
    if read_while_gone:
        assert _poll(follower) == 0
        assert _contents(follower.index) == {}
    deadline = time.monotonic() + 10  # its first try may meet the connection the restart broke
    while not pub_b.publish("stored", NEW[:1]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _poll(follower) == 1
    assert _contents(follower.index) == {NEW[0]: {B}}
    assert _gaps(metrics) == {"sequence": 0, "trimmed": 0, "recreated": 1}
    assert len(_gap_lines(caplog)) == 1
    for p in (pub_a, pub_b):
        p.close()


def test_events_a_replica_could_not_publish_drop_only_that_replica(
    private_redis, caplog: pytest.LogCaptureFixture
) -> None:
    server = private_redis()
    metrics, pub_a, pub_b, follower = _following(server.url)

    # Redis refuses A's reset (out of memory): the stream itself loses nothing, A's numbers jump.
    client = redis.Redis.from_url(server.url)
    client.config_set("maxmemory", 1)
    assert not pub_a.publish("removed", HS[:3])
    client.config_set("maxmemory", 0)
    assert pub_a.publish("stored", NEW[:1])

    caplog.set_level(logging.WARNING, logger="ferry.router")
    assert follower.poll_once() == 1
    assert _contents(follower.index) == {HS[0]: {B}, NEW[0]: {A}}
    assert _gaps(metrics) == {"sequence": 1, "trimmed": 0, "recreated": 0}
    assert len(_gap_lines(caplog)) == 1 and "events 3 to 3" in _gap_lines(caplog)[0]
    for p in (pub_a, pub_b):
        p.close()


def test_a_gap_in_held_events_discards_those_before_it(private_redis) -> None:
    """A replica's instance the router cannot place yet (its /health names none so far): the events
    held back from before a gap in that instance's numbers would rebuild a cache that changed."""
    server = private_redis()
    metrics = RouterMetrics()
    pub_a = KVEventPublisher(server.url, FP, replica_id=A, instance_id="a-2")
    health: dict[str, str | None] = {A: None}
    follower = KVEventFollower(
        server.url,
        PrefixIndex(100),
        known_url=lambda u: u == A,
        instance_of=health.get,
        gap_counter=metrics.kv_event_gaps,
    )
    assert pub_a.publish("stored", HS[:3])
    assert follower.poll_once() == 0  # held until /health names a-2
    client = redis.Redis.from_url(server.url)
    client.config_set("maxmemory", 1)
    assert not pub_a.publish("removed", HS[:3])
    client.config_set("maxmemory", 0)
    assert pub_a.publish("stored", NEW[:1])
    assert follower.poll_once() == 0
    health[A] = "a-2"
    assert follower.settle() == 1
    assert _contents(follower.index) == {NEW[0]: {A}}
    assert _gaps(metrics) == {"sequence": 1, "trimmed": 0, "recreated": 0}
    pub_a.close()


def test_publishers_own_maxlen_trims_past_the_router(redis_url: str) -> None:
    """What a long outage of the router's reads does in production: the replicas' own
    ``XADD MAXLEN ~`` trims (whole stream nodes) the events the router has not read."""
    metrics = RouterMetrics()
    pub_a = KVEventPublisher(redis_url, FP, replica_id=A, instance_id="a-1", maxlen=10)
    follower = _follower(redis_url, metrics)
    assert pub_a.publish("stored", HS[:3])
    assert follower.poll_once() == 1
    assert pub_a.publish("removed", HS[:3])
    blocks = [i.to_bytes(2, "big") * 8 for i in range(300)]
    for block in blocks:
        assert pub_a.publish("stored", [block])
    client = redis.Redis.from_url(redis_url)
    kept = [fields[b"hashes"].decode() for _id, fields in client.xrange(events_stream(FP))]
    assert 10 <= len(kept) < 300  # trimmed, and not past the newest 10

    assert follower.poll_once() == len(kept)
    index = follower.index
    index.check_integrity()
    assert len(index) == len(kept)
    assert [index.holders(b) for b in blocks[-len(kept) :]] == [{A}] * len(kept)
    assert [index.holders(h) for h in HS] == [set()] * 4
    assert _gaps(metrics) == {"sequence": 0, "trimmed": 1, "recreated": 0}
    pub_a.close()


def test_a_replicas_events_on_two_models_streams_are_numbered_apart(redis_url: str) -> None:
    """After a weight update a replica's events queued before it still go to the old model's stream,
    between those of the new model's. Each stream numbers its own: whichever stream the follower
    reads first, neither jumps (one count over both jumped in one of these two orders)."""
    metrics, pub_a, pub_b, follower = _following(redis_url)
    for old_first in (False, True):
        for on_old in (old_first, not old_first, old_first):
            assert pub_a.publish("stored", NEW[:1], fingerprint=None if on_old else "fpgap-new")
        follower.poll_once()
    assert _gaps(metrics) == {"sequence": 0, "trimmed": 0, "recreated": 0}
    assert _contents(follower.index) == {HS[0]: {A, B}, HS[1]: {A}, HS[2]: {A}, NEW[0]: {A}}
    for p in (pub_a, pub_b):
        p.close()
