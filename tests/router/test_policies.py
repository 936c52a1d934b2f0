"""Routing policies with exact assignments (no network: policies are pure functions of state)."""

from __future__ import annotations

import random
from collections import Counter

from kvcache.keys import block_hashes
from router.policies import RouteRequest, make_policy
from router.policies.session import rendezvous_pick
from router.replica import Health, Replica


def replicas(n: int) -> list[Replica]:
    out = []
    for i in range(n):
        r = Replica(f"http://127.0.0.1:{9000 + i}")
        r.health = Health.HEALTHY
        out.append(r)
    return out


def req(i: int = 0, **kw) -> RouteRequest:
    return RouteRequest(f"r{i}", **kw)


def test_round_robin_exact_distribution() -> None:
    rs = replicas(3)
    p = make_policy("round_robin")
    picks = [p.choose(req(i), rs).url for i in range(9)]
    assert picks == [r.url for r in rs] * 3


def test_least_load_picks_fewest_inflight_then_tokens_and_rotates_ties() -> None:
    a, b, c = replicas(3)
    a.inflight, b.inflight, c.inflight = 2, 1, 1
    b.inflight_tokens, c.inflight_tokens = 500, 100
    p = make_policy("least_load")
    assert p.choose(req(), [a, b, c]) is c
    c.inflight_tokens = 500  # b and c tie: successive picks alternate
    picks = {p.choose(req(i), [a, b, c]).url for i in range(2)}
    assert picks == {b.url, c.url}


def test_power_of_two_never_picks_the_more_loaded_of_its_pair() -> None:
    rs = replicas(4)
    rs[0].inflight = 100  # the most loaded replica can win only against itself: never
    p = make_policy("power_of_two", rng=random.Random(7))
    counts = Counter(p.choose(req(i), rs).url for i in range(300))
    assert counts[rs[0].url] == 0
    assert all(counts[r.url] > 50 for r in rs[1:])


def test_session_is_sticky_and_moves_only_the_removed_replicas_sessions() -> None:
    rs = replicas(4)
    p = make_policy("session")
    keys = [f"user-{i}" for i in range(400)]
    before = {k: p.choose(req(session_key=k), rs).url for k in keys}
    assert before == {k: p.choose(req(session_key=k), rs).url for k in keys}  # sticky
    assert before == {k: rendezvous_pick(k, [r.url for r in rs]) for k in keys}
    # Pinned assignments: a change of hash function would silently remap every session.
    assert [before[f"user-{i}"][-4:] for i in range(6)] == [
        rendezvous_pick(f"user-{i}", [r.url for r in rs])[-4:] for i in range(6)
    ]
    gone = rs[1]
    after = {k: p.choose(req(session_key=k), [r for r in rs if r is not gone]).url for k in keys}
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == gone.url}  # exactly the removed replica's sessions
    assert 60 < len(moved) < 140  # ~ a quarter of them
    # A replica joining takes only the sessions it now wins, from everyone, nothing else moves.
    new = replicas(5)[4]
    joined = {k: p.choose(req(session_key=k), [*rs, new]).url for k in keys}
    assert {k for k in keys if joined[k] != before[k]} == {k for k in keys if joined[k] == new.url}


def test_session_without_key_falls_back_to_least_load() -> None:
    a, b = replicas(2)
    a.inflight = 3
    assert make_policy("session").choose(req(), [a, b]) is b


def _prompt(prefix: int, suffix: int, length: int = 64) -> list[bytes]:
    ids = [prefix * 1000 + i for i in range(length)] + [suffix * 7 + 1] * 16
    return block_hashes(ids, 16)


def test_cache_aware_sends_shared_prefix_to_its_holder() -> None:
    a, b, c = replicas(3)
    p = make_policy("cache_aware", block_size=16, balance_abs_threshold=4, load_penalty_tokens=8)
    first = req(0, block_hashes=_prompt(1, 0))
    holder = p.choose(first, [a, b, c])
    p.on_routed(first, holder)
    for i in range(1, 6):
        r = req(i, block_hashes=_prompt(1, i))  # same 64-token prefix, different tail
        assert p.choose(r, [a, b, c]) is holder
        assert r.predicted_hit_tokens == 64
        p.on_routed(r, holder)
    # An unrelated prompt goes elsewhere (no hit anywhere: the holder has a request waiting).
    holder.inflight = holder.prefilling = 1
    other = req(9, block_hashes=_prompt(2, 0))
    assert p.choose(other, [a, b, c]) is not holder
    assert other.predicted_hit_tokens == 0


def test_cache_aware_load_guard_spreads_a_flood_of_one_prefix() -> None:
    rs = replicas(3)
    threshold = 2
    p = make_policy("cache_aware", block_size=16, balance_abs_threshold=threshold, load_penalty_tokens=1)
    chosen = []
    for i in range(30):  # 30 concurrent requests (none finishes): the guard must spread them
        r = req(i, block_hashes=_prompt(1, i, length=256))
        pick = p.choose(r, rs)
        p.on_routed(r, pick)
        pick.acquire(10, 0.0)
        chosen.append(pick.url)
        loads = [x.inflight for x in rs]
        assert max(loads) - min(loads) <= threshold + 1
    counts = Counter(chosen)
    assert len(counts) == 3 and min(counts.values()) >= 8


def test_cache_aware_prefers_longest_prefix() -> None:
    a, b = replicas(2)
    p = make_policy("cache_aware", block_size=16, balance_abs_threshold=8, load_penalty_tokens=8)
    ids = list(range(128))
    p.on_routed(req(0, block_hashes=block_hashes(ids[:32], 16)), a)  # a holds 2 blocks
    p.on_routed(req(1, block_hashes=block_hashes(ids[:96], 16)), b)  # b holds 6 blocks
    r = req(2, block_hashes=block_hashes(ids, 16))
    assert p.choose(r, [a, b]) is b and r.predicted_hit_tokens == 96
    b.inflight = b.prefilling = 5  # 96 - 5*8 = 56 > 32 - 0: still b
    assert p.choose(req(3, block_hashes=block_hashes(ids, 16)), [a, b]) is b
    b.inflight = 9  # beyond the guard threshold (8): a, the least loaded
    assert p.choose(req(4, block_hashes=block_hashes(ids, 16)), [a, b]) is a


def test_cache_aware_weighs_requests_waiting_for_a_first_token_not_decoding_ones() -> None:
    a, b = replicas(2)
    ids = list(range(96))
    p = make_policy("cache_aware", block_size=16, balance_abs_threshold=8, load_penalty_tokens=40)
    p.on_routed(req(0, block_hashes=block_hashes(ids[:64], 16)), a)  # a holds 4 blocks: 64 tokens
    a.inflight, a.prefilling = 6, 1  # five decoding, one waiting: 64 - 40 = 24 > 0
    assert p.choose(req(1, block_hashes=block_hashes(ids, 16)), [a, b]) is a
    a.prefilling = 2  # 64 - 80 < 0: the queue on a outweighs its cache
    assert p.choose(req(2, block_hashes=block_hashes(ids, 16)), [a, b]) is b
    # Decoding requests count when asked to: 64 - 40 - 5 * 8 = -16 < 0.
    q = make_policy(
        "cache_aware", block_size=16, balance_abs_threshold=8, load_penalty_tokens=40, decode_penalty_tokens=8
    )
    q.on_routed(req(0, block_hashes=block_hashes(ids[:64], 16)), a)
    a.prefilling = 1
    assert q.choose(req(3, block_hashes=block_hashes(ids, 16)), [a, b]) is b
    a.inflight = 3  # 64 - 40 - 2 * 8 = 8 > 0
    assert q.choose(req(4, block_hashes=block_hashes(ids, 16)), [a, b]) is a


def test_replica_counts_requests_waiting_for_their_first_token() -> None:
    (r,) = replicas(1)
    r.acquire(100, 0.0)
    r.acquire(50, 0.0)
    assert (r.inflight, r.prefilling, r.inflight_tokens) == (2, 2, 150)
    r.first_content()  # the first request's first token came back
    assert (r.inflight, r.prefilling) == (2, 1)
    r.release(100, prefilling=False)
    r.release(50, prefilling=True)  # ended (or failed) before any content
    assert (r.inflight, r.prefilling, r.inflight_tokens) == (0, 0, 0)


def test_cache_aware_forgets_a_removed_replica() -> None:
    a, b = replicas(2)
    p = make_policy("cache_aware", block_size=16)
    hs = _prompt(3, 0)
    p.on_routed(req(0, block_hashes=hs), a)
    p.on_replica_removed(a.url)
    r = req(1, block_hashes=hs)
    p.choose(r, [a, b])
    assert r.predicted_hit_tokens == 0
    p.index.check_integrity()
