"""A restarted replica's KV events and its /health race to tell the router; whichever comes first,
the prefix index holds the new process's blocks only: never the old one's beside them, never none
of the new one's. Real publishers on a real Redis stream, the router's real follower and index;
``health`` stands for what the replica's /health named last (``Replica.instance_id``)."""

from __future__ import annotations

import httpx
import redis
from router_harness import Cluster, Proc, free_port, metric, replica_args, replicas_view, wait_until

from kvcache.events import KVEvent, KVEventPublisher, KVEventReader
from kvcache.keys import block_hashes, to_hex
from router.kv_events import STREAM_PATTERN, KVEventFollower
from router.prefix_index import PrefixIndex

A = "http://127.0.0.1:9001"
OLD = block_hashes(list(range(48)), 16)  # 3 blocks the first process held
NEW = block_hashes(list(range(500, 532)), 16)  # 2 blocks the restarted one holds


def _follower(redis_url: str, health: dict[str, str]) -> tuple[KVEventFollower, PrefixIndex]:
    index = PrefixIndex(100)
    follower = KVEventFollower(redis_url, index, known_url=lambda u: u == A, instance_of=health.get)
    return follower, index


def _held(index: PrefixIndex) -> tuple[int, int]:
    return index.match(OLD, [A])[A], index.match(NEW, [A])[A]


def test_events_of_the_new_instance_before_the_probe(redis_url: str) -> None:
    """The restarted process's first events are read before the probe sees the restart: the old
    blocks go at once, and the probe that follows keeps the new ones."""
    health = {A: "first"}
    first = KVEventPublisher(redis_url, "fp", A, instance_id="first")
    second = KVEventPublisher(redis_url, "fp", A, instance_id="second")
    follower, index = _follower(redis_url, health)
    assert first.publish("stored", OLD)
    assert follower.poll_once() == 1 and _held(index) == (3, 0)
    assert second.publish("stored", NEW)  # the replica restarted; /health not probed since
    assert follower.poll_once() == 1
    assert _held(index) == (0, 2)
    health[A] = "second"  # now the probe sees it
    follower.restarted(A, "second")
    assert _held(index) == (0, 2)
    assert second.publish("removed", NEW[1:])  # and the new process's events go on applying
    assert follower.poll_once() == 1 and _held(index) == (0, 1)
    index.check_integrity()
    for p in (first, second):
        p.close()


def test_the_old_instance_events_read_after_the_probe_are_stale(redis_url: str) -> None:
    """The probe sees the restart first while the follower lags (a Redis outage): the old process's
    events still in the stream are never applied; the new one's are."""
    health = {A: "first"}
    first = KVEventPublisher(redis_url, "fp", A, instance_id="first")
    second = KVEventPublisher(redis_url, "fp", A, instance_id="second")
    follower, index = _follower(redis_url, health)
    assert first.publish("stored", OLD[:1])
    assert follower.poll_once() == 1
    assert first.publish("stored", OLD[1:])  # published, not read yet
    health[A] = "second"
    follower.restarted(A, "second")
    assert _held(index) == (0, 0)
    assert second.publish("stored", NEW)
    assert follower.poll_once() == 1  # the old process's second entry skipped, the new one's applied
    assert _held(index) == (0, 2)
    assert follower.counts["stale"] == 1
    for p in (first, second):
        p.close()


def test_a_router_reading_the_stream_from_its_start_applies_the_live_instance_only(redis_url: str) -> None:
    """A router starting (or re-reading after its start) meets the events of every process that
    served the URL: only the one /health names now counts, however many came before it."""
    old = KVEventPublisher(redis_url, "fp", A, instance_id="gone")
    live = KVEventPublisher(redis_url, "fp", A, instance_id="live")
    assert old.publish("stored", OLD) and old.publish("stored", NEW[:1])
    assert live.publish("stored", NEW)
    follower, index = _follower(redis_url, {A: "live"})
    assert follower.poll_once() == 1
    assert _held(index) == (0, 2)
    assert follower.counts["held"] == 2 and follower.counts["discarded"] == 2
    for p in (old, live):
        p.close()


def test_events_of_an_instance_health_has_not_named_wait_for_it(redis_url: str) -> None:
    """/health names the old process still (the probe is due), while the follower has not read
    any of the old one's events: the new events wait, and apply when the probe names them."""
    health = {A: "first"}
    second = KVEventPublisher(redis_url, "fp", A, instance_id="second")
    follower, index = _follower(redis_url, health)
    assert second.publish("stored", NEW)
    assert follower.poll_once() == 0 and _held(index) == (0, 0)
    health[A] = "second"
    follower.restarted(A, "second")
    assert _held(index) == (0, 2)
    second.close()


def test_events_read_before_the_first_probe_wait_for_it(redis_url: str) -> None:
    """A replica down when the router starts (no /health yet): its past processes' events in the
    stream are held, and only the one its first good probe names applies."""
    gone = KVEventPublisher(redis_url, "fp", A, instance_id="gone")
    live = KVEventPublisher(redis_url, "fp", A, instance_id="live")
    assert gone.publish("stored", OLD) and live.publish("stored", NEW)
    health: dict[str, str] = {}
    follower, index = _follower(redis_url, health)
    assert follower.poll_once() == 0 and _held(index) == (0, 0)
    health[A] = "live"  # its first good probe
    assert follower.poll_once() == 1 and _held(index) == (0, 2)
    assert follower.counts["discarded"] == 1
    assert follower.poll_once() == 0
    for p in (gone, live):
        p.close()


# ---- real replicas: a replica restarts behind a router that will not probe it for 10 minutes ----

P1 = [(3 * i + 7) % 900 + 10 for i in range(40)]  # token ids: 2 full blocks of 16
P2 = [(5 * i + 11) % 900 + 10 for i in range(40)]


def _predicted(router: Proc, prompt: list[int]) -> float:
    """Prompt tokens the router predicted its replica holds, for one request of ``prompt``."""
    before = metric(router.url, "ferry:router_cache_hit_tokens_total")
    _complete(router.url, prompt)
    return metric(router.url, "ferry:router_cache_hit_tokens_total") - before


def _complete(url: str, prompt: list[int]) -> None:
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text


def _device_events(redis_url: str) -> list[KVEvent]:
    """Every device event on the stream (one model: one stream), none before the replica's writer
    thread first appends to it (after the request that stored the blocks has been answered)."""
    streams = [k.decode() for k in redis.Redis.from_url(redis_url).scan_iter(match=STREAM_PATTERN)]
    assert len(streams) <= 1
    if not streams:
        return []
    reader = KVEventReader(redis_url, streams[0].rsplit(":", 1)[1])
    events = [e for e in reader.read(count=10_000) if e.medium == "device"]
    reader.close()
    return events


def _stored(events: list[KVEvent], instance: str) -> set[str]:
    return {h for e in events if e.kind == "stored" and e.instance == instance for h in e.block_hashes}


def _router_read(router: Proc, redis_url: str, instance: str, prompt: list[int]) -> bool:
    """The replica's (``instance``) events say it holds ``prompt``'s blocks, and the router has
    applied every device event on the stream."""
    events = _device_events(redis_url)
    applied = metric(router.url, "ferry:router_kv_events_total", {"outcome": "applied"})
    return set(to_hex(block_hashes(prompt, 16))) <= _stored(events, instance) and applied == len(events)


def test_a_restarted_replica_is_known_by_its_events_before_its_probe(cluster: Cluster, private_redis) -> None:
    """The router learns the restart from the new process's first KV events: the old process's
    blocks are forgotten at once (it would send P1's followers there for a cache hit that is not
    there), the new process's blocks are known (P2, sent to the replica itself)."""
    tier = private_redis().url
    events = ("--kv-tier", tier, "--kv-events", "--num-kv-blocks", "64")
    port = free_port()
    (replica,) = cluster.replicas(1, *events, ports=[port])
    router = cluster.router(
        "--replica", replica.url, "--policy", "cache_aware", "--model", str(cluster.model),
        "--kv-tier", tier, "--health-interval", "600",
    )  # fmt: skip
    first = replicas_view(router)[replica.url]["instance_id"]  # probed at its start, next in 10 min
    assert first == httpx.get(replica.url + "/health").json()["instance_id"]
    _complete(router.url, P1)
    assert wait_until(lambda: _router_read(router, tier, first, P1))
    assert _predicted(router, P1) == 32
    replica.stop()
    restarted = Proc(replica_args(cluster.model, port, *events), port, replica.log).start()
    cluster.procs.append(restarted)
    restarted.wait_http()
    second = httpx.get(restarted.url + "/health").json()["instance_id"]
    _complete(restarted.url, P2)  # straight to the replica: the router learns it from events only
    assert wait_until(lambda: _router_read(router, tier, second, P2))
    assert replicas_view(router)[replica.url]["instance_id"] == first  # the probe has not seen it
    assert _predicted(router, P1) == 0
    assert _predicted(router, P2) == 32
