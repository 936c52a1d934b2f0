"""Health state machine, circuit breaker, retry/backoff and overload control (fake clock)."""

from __future__ import annotations

import asyncio
import random

from router.admission import Admission
from router.replica import Circuit, Health, HealthPolicy, Replica
from router.retry import RetryPolicy


def test_starting_replica_failures_are_not_errors() -> None:
    r = Replica("http://x", policy=HealthPolicy(probe_interval=1.0, probe_backoff_max=8.0))
    assert r.health is Health.STARTING and not r.routable(0.0)
    for t in range(5):
        r.on_probe_fail(float(t))
    assert r.health is Health.STARTING and r.circuit.consecutive_failures == 0
    assert r.probe_delay == 8.0  # backed off to the cap
    r.on_probe_ok(10.0)
    assert r.health is Health.HEALTHY and r.routable(10.0) and r.next_probe_at == 11.0


def test_ejection_after_probe_failures_and_readmission() -> None:
    r = Replica("http://x", policy=HealthPolicy(probe_interval=1.0, eject_after_probe_failures=2))
    r.on_probe_ok(0.0)
    r.on_probe_fail(1.0)
    assert r.health is Health.HEALTHY  # one failed probe is not enough
    r.on_probe_fail(2.0)
    assert r.health is Health.EJECTED and not r.routable(2.0)
    r.on_probe_fail(3.0)
    assert r.next_probe_at == 3.0 + 2.0  # backing off while down
    r.on_probe_ok(5.0)
    assert r.health is Health.HEALTHY and r.routable(5.0)


def test_connect_error_ejects_at_once_and_probes_soon() -> None:
    r = Replica("http://x", policy=HealthPolicy(probe_interval=1.0))
    r.on_probe_ok(0.0)
    r.on_connect_error(0.5)
    assert r.health is Health.EJECTED and r.next_probe_at == 0.75


def test_circuit_opens_half_opens_and_closes() -> None:
    r = Replica(
        "http://x", policy=HealthPolicy(circuit_failures=3, circuit_cooldown=5.0, circuit_cooldown_max=20)
    )
    r.on_probe_ok(0.0)
    for t in (1.0, 1.1):
        r.on_request_failure(t)
    assert r.circuit.state is Circuit.CLOSED and r.routable(1.2)
    r.on_request_failure(1.2)
    assert r.circuit.state is Circuit.OPEN and not r.routable(6.1)
    assert r.routable(6.2)  # cooldown over: one trial request may go
    r.acquire(1, 6.2)
    assert r.circuit.state is Circuit.HALF_OPEN and not r.routable(6.3)  # only one trial at a time
    r.on_request_failure(6.5)  # trial failed: open again, cooldown doubled
    assert r.circuit.state is Circuit.OPEN and r.circuit.cooldown == 10.0
    assert not r.routable(16.25) and r.routable(16.6)
    r.acquire(1, 16.5)
    r.on_request_success()
    assert r.circuit.state is Circuit.CLOSED and r.circuit.cooldown == 5.0 and r.routable(16.6)


def test_retry_policy_statuses_and_jittered_backoff() -> None:
    p = RetryPolicy(max_retries=2, backoff_base=0.1, backoff_cap=0.3)
    assert [s for s in (400, 404, 429, 500, 502, 503, 504) if p.should_retry_status(s, 0)] == [
        429,
        502,
        503,
        504,
    ]
    assert not p.should_retry_status(503, 2)
    rng = random.Random(1)
    for attempt, ceiling in ((0, 0.1), (1, 0.2), (2, 0.3), (5, 0.3)):
        waits = [p.backoff(attempt, rng) for _ in range(200)]
        assert all(0 <= w <= ceiling for w in waits) and max(waits) > 0.8 * ceiling


async def test_admission_limits_queue_and_fifo_handoff() -> None:
    adm = Admission(max_concurrency=2, max_queue=1, queue_timeout=5.0)
    assert await adm.try_acquire() and await adm.try_acquire()
    waiter = asyncio.create_task(adm.try_acquire())
    await asyncio.sleep(0)
    assert adm.queued == 1
    assert await adm.try_acquire() is False  # queue full: refused at once
    adm.release()  # the slot goes straight to the waiter
    assert await waiter is True and adm.active == 2
    adm.release()
    adm.release()
    assert adm.active == 0


async def test_admission_queue_timeout_and_cancelled_waiter() -> None:
    adm = Admission(max_concurrency=1, max_queue=4, queue_timeout=0.05)
    assert await adm.try_acquire()
    assert await adm.try_acquire() is False  # timed out in the queue
    assert adm.queued == 0
    w = asyncio.create_task(adm.try_acquire())
    await asyncio.sleep(0)
    w.cancel()
    await asyncio.gather(w, return_exceptions=True)
    assert adm.queued == 0
    adm.release()
    assert adm.active == 0
