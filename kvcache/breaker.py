"""Failure isolation for remote tiers: a circuit breaker and the ``GuardedTier`` wrapper.

When Redis is down or slow, the engine must not feel it: every call is already bounded by
socket timeouts, and after ``failure_threshold`` consecutive failures the breaker *opens*
and calls return a miss at once, without touching the network. Once ``cooldown_s`` has
passed, the next call (still answered with a miss at once) starts a *half-open* probe — one
cheap ``contains_prefix`` on a background thread, so no engine-thread call ever waits on a
dead host's connect timeout. Success closes the breaker (hits resume by themselves); failure
re-opens it for another cool-down. Each close after an open counts in ``recoveries`` (the tier's
``epoch``): the writes dropped meanwhile are what the re-publication pass makes up for. A call is
what starts a probe, so an idle replica would only probe at its next request: ``GuardedTier.poll``
(each engine step and idle step) starts it as well, once the cool-down passed, and while the breaker
is closed runs the backend's periodic ``watch`` (a Redis tier's flush check) the same way, on a
background thread. An error the server answers with (a full Redis refusing
writes, a read-only replica) is counted and logged but opens nothing: the server is reachable,
and what it still serves (reads, when only writes are refused) goes on. Nothing here ever raises
to the caller.
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
    DROP_MISCONF,
    DROP_OOM,
    DROP_READONLY,
    DROP_REFUSED,
    ERROR_CIRCUIT_OPEN,
    ERROR_CONNECTION,
    ERROR_INTERNAL,
    ERROR_RESPONSE,
    ERROR_TIMEOUT,
    ErrorCounter,
    TierStats,
    merge_errors,
)
from kvcache.tier import PartialWriteError, Tier, note_refused, note_unanswered

logger = logging.getLogger(__name__)

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
PROBE_KEY = "ferry:kv:probe"  # never written: the probe only asks whether the server answers
RESPONSE_LOG_INTERVAL_S = 60.0  # a server's refusals of one call kind are logged this seldom
ERROR_TEXT_LIMIT = 200  # characters of an error's message in a log line
# How soon an idle engine looks again at a probe or flush check under way (``poll_due_in``): it takes
# a round trip (about a millisecond) and its answer may start a re-publication pass.
CHECK_RUNNING_POLL_S = 0.05
# redis-py names a failed pipeline command with its arguments (a block's raw bytes) before the
# server's answer: "Command # 1 (SET key <bytes>) of pipeline caused error: <answer>".
_PIPELINE_ERROR = " of pipeline caused error: "

T = TypeVar("T")


class CircuitBreaker:
    """Closed → (N consecutive failures) → open → (cool-down) → half-open probe → closed | open.

    In half-open state exactly one probe is out; everything else is refused until it reports.
    """

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
        self.times_opened = 0
        self.recoveries = 0  # closes after an open: each one may follow dropped writes

    @property
    def state(self) -> str:
        with self._lock:
            return self._state

    def is_closed(self) -> bool:
        with self._lock:
            return self._state == CLOSED

    def probe_due_in(self) -> float | None:
        """Seconds until an open breaker's cool-down has passed (0: now); None unless open."""
        with self._lock:
            if self._state != OPEN:
                return None
            return max(0.0, self._opened_at + self.cooldown_s - self._clock())

    def begin_probe(self) -> bool:
        """Open and cooled down, with no probe out: become half-open; the caller runs the probe."""
        with self._lock:
            if self._state != OPEN or self._clock() - self._opened_at < self.cooldown_s:
                return False
            self._state = HALF_OPEN
            return True

    def allow(self) -> bool:
        """For callers that may block (background threads): closed, or this call is the probe."""
        return self.is_closed() or self.begin_probe()

    def record_success(self) -> None:
        with self._lock:
            if self._state != CLOSED:
                logger.warning("KV tier reachable again; circuit breaker closed")
                self.recoveries += 1
            self._state = CLOSED
            self._failures = 0

    def record_failure(self) -> None:
        with self._lock:
            if self._state == HALF_OPEN:
                self._open()
                return
            self._failures += 1
            if self._state == CLOSED and self._failures >= self.failure_threshold:
                self._open()

    def _open(self) -> None:
        if self._state == CLOSED:  # not again after each failed probe: once per outage
            logger.warning(
                "KV tier failing; circuit breaker open for %.2fs (calls return misses meanwhile)",
                self.cooldown_s,
            )
        self._state = OPEN
        self._opened_at = self._clock()
        self.times_opened += 1


def _redis_exceptions():  # noqa: ANN202 - the module, or None
    """redis-py's exceptions module, imported here so the breaker itself has no hard dependency on
    redis-py (None without it)."""
    try:
        import redis.exceptions as rexc
    except ImportError:  # pragma: no cover - redis is a project dependency
        return None
    return rexc


def classify_error(exc: BaseException) -> str:
    """Map an exception from a tier backend to an error kind (the metric label)."""
    rexc = _redis_exceptions()
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


def refusal_reason(exc: BaseException) -> str:
    """Why the server refused a write (the ``reason`` label of a dropped write): over ``maxmemory``
    under ``noeviction``, a read-only replica, writes stopped for failing RDB saves, or another."""
    rexc = _redis_exceptions()
    if rexc is not None:
        if isinstance(exc, rexc.OutOfMemoryError):
            return DROP_OOM
        if isinstance(exc, rexc.ReadOnlyError):
            return DROP_READONLY
    text = str(exc)
    if _PIPELINE_ERROR in text:
        text = text.split(_PIPELINE_ERROR, 1)[1]
    code = text.lstrip().split(" ", 1)[0].upper()
    return {"OOM": DROP_OOM, "READONLY": DROP_READONLY, "MISCONF": DROP_MISCONF}.get(code, DROP_REFUSED)


def error_text(exc: BaseException) -> str:
    """``exc`` for a log line: its class and message, a failed pipeline command's arguments left out
    (they hold the block's bytes), characters that are not printable escaped, the message cut at
    ``ERROR_TEXT_LIMIT`` characters."""
    text = str(exc)
    if _PIPELINE_ERROR in text:
        text = text.split(_PIPELINE_ERROR, 1)[1]
    if len(text) > ERROR_TEXT_LIMIT:
        text = text[:ERROR_TEXT_LIMIT] + "..."
    text = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
    return f"{type(exc).__name__}: {text}"


class GuardedTier(Tier):
    """Wrap a backend that may raise: bound it with a breaker, count errors, return misses."""

    def __init__(self, inner: Tier, breaker: CircuitBreaker | None = None, *, name: str = "tier") -> None:
        self.inner = inner
        self.breaker = breaker or CircuitBreaker()
        self.name = name
        self._errors = ErrorCounter()
        self._probe: threading.Thread | None = None
        self._watch: threading.Thread | None = None  # the backend's periodic check (``poll``)
        self._refusals_logged: dict[str, float] = {}  # call kind -> when a refusal was last logged

    def contains_prefix(self, keys: Sequence[str]) -> int:
        return self._call("contains_prefix", lambda: self.inner.contains_prefix(keys), 0)

    def contains_prefix_many(self, key_lists: Sequence[Sequence[str]]) -> list[int]:
        misses = [0] * len(key_lists)
        return self._call("contains_prefix", lambda: self.inner.contains_prefix_many(key_lists), misses)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return self._call("get_many", lambda: self.inner.get_many(keys), None) or [None] * len(keys)

    def contains_many(self, keys: Sequence[str]) -> list[bool] | None:
        return self._call("contains_many", lambda: self.inner.contains_many(keys), None)

    def epoch(self) -> int:
        return self.breaker.recoveries + self.inner.epoch()

    def available(self) -> bool:
        return self.breaker.is_closed()

    def poll(self) -> None:
        """Start what is due on a background thread: the probe, once an open breaker's cool-down
        passed (at most one per cool-down: ``begin_probe``), or, closed, the backend's ``watch``.
        Counts nothing as a skipped call: no call was asked for."""
        if self.breaker.is_closed():
            watch = self._watch
            if (watch is None or not watch.is_alive()) and self.inner.watch_due():
                self._watch = threading.Thread(target=self._run_watch, name=f"{self.name}-watch", daemon=True)
                self._watch.start()
        elif self.breaker.begin_probe():
            self._start_probe()

    def poll_due_in(self) -> float | None:
        """When ``poll`` next has work: the backend's next check while closed (or, one running, a
        short while: its answer may move the epoch), the end of an open breaker's cool-down; a
        probe out is answered within the socket timeouts, so it is looked at again as shortly."""
        if self.breaker.is_closed():
            watch = self._watch
            if watch is not None and watch.is_alive():
                return CHECK_RUNNING_POLL_S
            return self.inner.watch_due_in()
        due = self.breaker.probe_due_in()
        return CHECK_RUNNING_POLL_S if due is None else due

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        failed = [False] * len(items)
        if not self._admit():
            return failed
        try:
            stored = self.inner.put_many(items)
        except PartialWriteError as exc:
            # What the server acknowledged before the failure stays written (and counted so).
            self._failed_write(exc.cause)
            return exc.stored
        except Exception as exc:
            self._failed_write(exc)
            return failed
        self.breaker.record_success()
        return stored

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

    def wait_for_probe(self, timeout: float | None = None) -> None:
        """Wait for a running background probe or watch (tests, shutdown)."""
        for thread in (self._probe, self._watch):
            if thread is not None:
                thread.join(timeout)

    def _admit(self) -> bool:
        """Whether a call may go to the backend now (an open breaker counts the skip, and may start
        the background probe)."""
        if self.breaker.is_closed():
            return True
        note_unanswered()
        self._errors.record(ERROR_CIRCUIT_OPEN)
        if self.breaker.begin_probe():
            self._start_probe()
        return False

    def _start_probe(self) -> None:
        self._probe = threading.Thread(target=self._run_probe, name=f"{self.name}-probe", daemon=True)
        self._probe.start()

    def _call(self, op: str, fn: Callable[[], T], on_failure: T) -> T:
        if not self._admit():
            return on_failure
        try:
            result = fn()
        except Exception as exc:
            note_unanswered()
            self._failed(op, exc)
            return on_failure
        self.breaker.record_success()
        return result

    def _run_probe(self) -> None:
        try:
            self.inner.contains_prefix([PROBE_KEY])
        except Exception as exc:
            self._failed("probe", exc)
            return
        self.breaker.record_success()

    def _run_watch(self) -> None:
        try:
            self.inner.watch()
        except Exception as exc:
            self._failed("watch", exc)
            return
        self.breaker.record_success()

    def _failed_write(self, exc: Exception) -> None:
        """A write failed: counted as any call, and a refusal by the server noted for the writer
        (``take_refused``), which counts its blocks by reason and writes them again later where the
        refusal may pass."""
        self._failed("put_many", exc)
        if classify_error(exc) == ERROR_RESPONSE:
            note_refused(refusal_reason(exc))

    def _failed(self, op: str, exc: Exception) -> None:
        kind = classify_error(exc)
        self._errors.record(kind)
        if kind == ERROR_RESPONSE:
            # The server answered: it is reachable, and a refusal of one kind of call (writes to a
            # full server under ``noeviction``, a read-only replica) is no reason to stop the others
            # (reads it still serves). Counted, and logged at most once a minute per call kind.
            self.breaker.record_success()
            now = time.monotonic()
            if now - self._refusals_logged.get(op, -RESPONSE_LOG_INTERVAL_S) >= RESPONSE_LOG_INTERVAL_S:
                self._refusals_logged[op] = now
                logger.warning(
                    "%s %s refused by the server (treated as a miss): %s", self.name, op, error_text(exc)
                )
            return
        self.breaker.record_failure()
        if kind == ERROR_INTERNAL:
            logger.error("%s %s failed unexpectedly; treated as a miss", self.name, op, exc_info=exc)
        else:
            logger.debug("%s %s failed (%s): %s", self.name, op, kind, error_text(exc))
