"""Failure isolation for remote tiers: a circuit breaker and the ``GuardedTier`` wrapper.

When Redis is down or slow, the engine must not feel it: every call is already bounded by
socket timeouts, and after ``failure_threshold`` consecutive failures the breaker *opens*
and calls return a miss at once, without touching the network, for ``cooldown_s``. Then
one caller is let through as a *half-open* probe: success closes the breaker (hits resume
by themselves), failure re-opens it for another cool-down. Nothing here ever raises to
the caller.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TypeVar

from kvcache.metrics import (
    ERROR_CIRCUIT_OPEN,
    ERROR_CONNECTION,
    ERROR_INTERNAL,
    ERROR_RESPONSE,
    ERROR_TIMEOUT,
    ErrorCounter,
    TierStats,
    merge_errors,
)
from kvcache.tier import Tier

logger = logging.getLogger(__name__)

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"

T = TypeVar("T")


class CircuitBreaker:
    """Closed → (N consecutive failures) → open → (cool-down) → half-open probe → closed | open."""

    def __init__(
        self, failure_threshold: int = 3, cooldown_s: float = 1.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if failure_threshold < 1:
            raise ValueError("failure_threshold must be >= 1")
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state = CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._probe_in_flight = False
        self.times_opened = 0

    @property
    def state(self) -> str:
        with self._lock:
            return self._state

    def allow(self) -> bool:
        """May a call go to the backend now? In half-open state only one probe at a time."""
        with self._lock:
            if self._state == CLOSED:
                return True
            if self._state == OPEN:
                if self._clock() - self._opened_at < self.cooldown_s:
                    return False
                self._state = HALF_OPEN
                self._probe_in_flight = False
            if self._probe_in_flight:
                return False
            self._probe_in_flight = True
            return True

    def record_success(self) -> None:
        with self._lock:
            if self._state != CLOSED:
                logger.warning("KV tier reachable again; circuit breaker closed")
            self._state = CLOSED
            self._failures = 0
            self._probe_in_flight = False

    def record_failure(self) -> None:
        with self._lock:
            self._probe_in_flight = False
            if self._state == HALF_OPEN:
                self._open()
                return
            self._failures += 1
            if self._state == CLOSED and self._failures >= self.failure_threshold:
                self._open()

    def _open(self) -> None:
        if self._state != OPEN:
            logger.warning(
                "KV tier failing; circuit breaker open for %.2fs (calls return misses meanwhile)",
                self.cooldown_s,
            )
        self._state = OPEN
        self._opened_at = self._clock()
        self.times_opened += 1


def classify_error(exc: BaseException) -> str:
    """Map an exception from a tier backend to an error kind (the metric label)."""
    # Imported here so the breaker itself has no hard dependency on redis-py.
    try:
        import redis.exceptions as rexc
    except ImportError:  # pragma: no cover - redis is a project dependency
        rexc = None
    if rexc is not None:
        if isinstance(exc, rexc.TimeoutError):
            return ERROR_TIMEOUT
        # AuthenticationError subclasses ConnectionError but is the server's answer, not an outage.
        if isinstance(exc, rexc.ResponseError | rexc.AuthenticationError | rexc.DataError):
            return ERROR_RESPONSE
        if isinstance(exc, rexc.ConnectionError):
            return ERROR_CONNECTION
    if isinstance(exc, socket.timeout | TimeoutError):
        return ERROR_TIMEOUT
    if isinstance(exc, ConnectionError | OSError):
        return ERROR_CONNECTION
    return ERROR_INTERNAL


class GuardedTier(Tier):
    """Wrap a backend that may raise: bound it with a breaker, count errors, return misses."""

    def __init__(self, inner: Tier, breaker: CircuitBreaker | None = None, *, name: str = "tier") -> None:
        self.inner = inner
        self.breaker = breaker or CircuitBreaker()
        self.name = name
        self._errors = ErrorCounter()

    def contains_prefix(self, keys: Sequence[str]) -> int:
        return self._call("contains_prefix", lambda: self.inner.contains_prefix(keys), 0)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return self._call("get_many", lambda: self.inner.get_many(keys), None) or [None] * len(keys)

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> bool:
        return self._call("put_many", lambda: self.inner.put_many(items), False)

    def close(self) -> None:
        try:
            self.inner.close()
        except Exception as exc:
            logger.debug("closing %s failed: %r", self.name, exc)

    def stats(self) -> TierStats:
        inner = self.inner.stats()
        return replace(
            inner,
            errors=merge_errors(inner.errors, self._errors.snapshot()),
            breaker_state=self.breaker.state,
        )

    def _call(self, op: str, fn: Callable[[], T], on_failure: T) -> T:
        if not self.breaker.allow():
            self._errors.record(ERROR_CIRCUIT_OPEN)
            return on_failure
        try:
            result = fn()
        except Exception as exc:
            kind = classify_error(exc)
            self._errors.record(kind)
            self.breaker.record_failure()
            if kind == ERROR_INTERNAL:
                logger.exception("%s %s failed unexpectedly; treated as a miss", self.name, op)
            else:
                logger.debug("%s %s failed (%s): %r", self.name, op, kind, exc)
            return on_failure
        self.breaker.record_success()
        return result
