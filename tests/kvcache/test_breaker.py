"""Circuit breaker state machine (driven by an explicit clock, so timing is exact)."""

from __future__ import annotations

import time

import pytest

from kvcache.breaker import CircuitBreaker, GuardedTier
from kvcache.memory_tier import MemoryTier


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_opens_after_consecutive_failures_and_probes_once() -> None:
    clock = Clock()
    b = CircuitBreaker(failure_threshold=3, cooldown_s=2.0, clock=clock)
    assert b.allow() and b.state == "closed"
    b.record_failure()
    b.record_failure()
    b.record_success()  # a success resets the count: failures must be consecutive
    b.record_failure()
    b.record_failure()
    assert b.state == "closed"
    b.record_failure()
    assert b.state == "open" and b.times_opened == 1
    assert not b.allow()
    clock.now += 1.99
    assert not b.allow()
    clock.now += 0.02
    assert b.allow() and b.state == "half_open"  # the single probe
    assert not b.allow() and not b.begin_probe()  # nobody else while the probe is out
    b.record_failure()  # probe failed: open again for a full cool-down
    assert b.state == "open" and b.times_opened == 2
    assert not b.allow()
    assert not b.begin_probe()
    clock.now += 2.0
    assert not b.is_closed() and b.begin_probe() and b.state == "half_open"
    b.record_success()
    assert b.state == "closed" and b.is_closed() and b.allow() and b.allow()


def test_threshold_must_be_positive() -> None:
    with pytest.raises(ValueError):
        CircuitBreaker(failure_threshold=0)


class Exploding(MemoryTier):
    """A real memory tier whose reads fail with a given exception while ``fail`` is set."""

    def __init__(self, exc: Exception) -> None:
        super().__init__(1000)
        self.exc = exc
        self.fail = True

    def get_many(self, keys):
        if self.fail:
            raise self.exc
        return super().get_many(keys)


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (ConnectionRefusedError(), "connection"),
        (TimeoutError(), "timeout"),
        (RuntimeError("bug"), "internal"),
    ],
)
def test_guarded_tier_classifies_and_never_raises(exc: Exception, kind: str, metric) -> None:
    clock = Clock()
    inner = Exploding(exc)
    inner.put_many([("k", b"v")])
    guarded = GuardedTier(inner, CircuitBreaker(2, 5.0, clock=clock))
    before = metric("ferry:kv_tier_errors_total", kind=kind)
    assert guarded.get_many(["k"]) == [None]
    assert guarded.get_many(["k"]) == [None]
    assert metric("ferry:kv_tier_errors_total", kind=kind) == before + 2
    assert guarded.stats().breaker_state == "open"
    inner.fail = False
    assert guarded.get_many(["k"]) == [None]  # still cooling down: not even tried
    assert guarded.stats().errors == {kind: 2, "circuit_open": 1}
    clock.now += 5.0
    # Cooled down: this call still answers a miss at once, and a background probe goes out.
    assert guarded.get_many(["k"]) == [None]
    guarded.wait_for_probe(5.0)
    assert guarded.stats().breaker_state == "closed"
    assert guarded.get_many(["k"]) == [b"v"]
    assert guarded.stats().errors == {kind: 2, "circuit_open": 2}


class SlowToFail(MemoryTier):
    """Every call blocks like a connect to a black-holed host, then fails."""

    def __init__(self, delay: float) -> None:
        super().__init__(1000)
        self.delay = delay

    def contains_prefix(self, keys):
        time.sleep(self.delay)
        raise TimeoutError("connect timed out")

    get_many = contains_prefix


def test_probes_never_block_the_caller() -> None:
    clock = Clock()
    guarded = GuardedTier(SlowToFail(1.0), CircuitBreaker(1, 1.0, clock=clock))
    assert guarded.get_many(["k"]) == [None]  # the first failure pays the timeout once
    clock.now += 1.0
    start = time.monotonic()
    for _ in range(20):
        assert guarded.get_many(["k"]) == [None]
    assert time.monotonic() - start < 0.8  # the 1 s probe runs on its own thread
    guarded.wait_for_probe(5.0)
    assert guarded.stats().breaker_state == "open"
    assert guarded.stats().errors == {"timeout": 2, "circuit_open": 20}
