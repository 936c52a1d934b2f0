"""The KV tier interface, the registry of backends by URL scheme, and ``open_tier``.

A tier is a byte store keyed by ``kvcache.keys.tier_key`` strings. It knows nothing about
tensors (that is ``codec``), so this module and every backend stay torch-free and the router
may use a tier too (e.g. ``contains_prefix`` for cache-aware routing).

Contract of the ``Tier`` methods (all thread-safe):

* ``contains_prefix(keys)``: how many *leading* keys the tier holds (stops at the first absent).
* ``contains_prefix_many(key_lists)``: ``contains_prefix`` of each list, in order; a remote
  backend answers them all in one round trip.
* ``get_many(keys)``: one value or ``None`` per key, in order.
* ``put_many(items)``: store ``(key, value)`` pairs; one flag per item, in order: ``True`` for a
  write the store acknowledged, ``False`` for one it refused, lost or pushed out again before the
  call returned. Exact, so that a write that fails part-way (Redis down mid-write, a full Redis,
  a memory bound) counts exactly its dropped blocks. A backend that fails part-way may raise
  ``PartialWriteError`` with the flags so far instead.
* ``close()``: release connections; later calls behave as misses.
* ``contains_many(keys)``: one flag per key, whether the tier holds it *where other processes read
  it* (a composite tier asks its shared level), or ``None`` when it cannot tell now (down): the
  re-publication pass (``kvcache/republish.py``) asks it to find the blocks a tier lacks.
* ``epoch()``: a count that grows each time the tier may have lost or missed this process's writes
  (a circuit breaker closing after it was open; a Redis server that restarted, empty). ``0`` for a
  tier that can do neither (``memory://``). Cheap: no I/O.
* ``available()``: whether a call now would reach the backend (a closed breaker); no I/O.
* ``poll()``: called every engine step and idle step: starts, on a background thread, the checks
  that are due (an open breaker's probe once its cool-down passed; a Redis tier's flush check every
  few seconds). No I/O on the caller's thread. ``watch_due()`` / ``watch()`` are a raw backend's
  side of it: whether its periodic check is due, and the check itself (I/O; may raise).
* ``poll_due_in()``: seconds until ``poll`` has something to start or a check it started may have
  an answer (``0``: now), ``None`` when nothing is scheduled: an idle engine sleeps that long and
  polls (no wake-up at all for a tier with no periodic check). ``watch_due_in()`` is a raw
  backend's (``None``: no periodic check). No I/O.

A backend may raise on I/O failure; what ``open_tier`` returns never does: failing backends
are wrapped in a circuit breaker (``breaker.GuardedTier``) and the outermost ``MeteredTier``
records the Prometheus metrics and turns anything unexpected into a counted miss. Such a miss is
not the backend's word that a block is absent: ``expect_answers()`` before a read and
``answered()`` after it tell, on the calling thread, whether every call of it was answered. Its
``get_many`` counts each value found as a hit; the engine's connector reads with ``fetch`` and
counts with ``count_blocks`` once it has checked the values, so a corrupt block is a miss.
"""

from __future__ import annotations

import importlib
import logging
import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import replace
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from kvcache.metrics import (
    ERROR_INTERNAL,
    KV_TIER_BYTES_READ,
    KV_TIER_BYTES_WRITTEN,
    KV_TIER_GET_SECONDS,
    KV_TIER_HITS,
    KV_TIER_MISSES,
    KV_TIER_PUT_SECONDS,
    ErrorCounter,
    TierStats,
    merge_errors,
)

logger = logging.getLogger(__name__)


_calls = threading.local()  # per thread: a call since ``expect_answers`` went unanswered


def expect_answers() -> None:
    """Before a read whose misses mean something (``answered``): forget earlier unanswered calls."""
    _calls.unanswered = False


def answered() -> bool:
    """Whether every tier call on this thread since ``expect_answers`` got the backend's answer (none
    failed, none was skipped by an open breaker): only then is a miss a block the tier lacks."""
    return not getattr(_calls, "unanswered", False)


def note_unanswered() -> None:
    """A tier call on this thread returned its default (a miss) without the backend's answer."""
    _calls.unanswered = True


def note_refused(reason: str) -> None:
    """A ``put_many`` on this thread was refused by the server, for ``reason`` (a ``DROP_*`` label of
    ``kvcache/metrics.py``): the writes it did not store were refused, not lost to an outage."""
    _calls.refused = reason


def take_refused() -> str | None:
    """The reason ``note_refused`` noted on this thread since the last call, if any; forgets it."""
    reason = getattr(_calls, "refused", None)
    _calls.refused = None
    return reason


class PartialWriteError(Exception):
    """A ``put_many`` that failed part-way (perhaps before its first item): ``stored`` flags each
    item as a return value would, ``cause`` is the failure (for the breaker and the metrics)."""

    def __init__(self, stored: list[bool], cause: Exception) -> None:
        super().__init__(f"{sum(stored)} of {len(stored)} writes stored before: {cause!r}")
        self.stored = stored
        self.cause = cause


class Tier(ABC):
    """A byte store of KV blocks addressed by tier key. See the module docstring for the contract."""

    @abstractmethod
    def contains_prefix(self, keys: Sequence[str]) -> int: ...

    def contains_prefix_many(self, key_lists: Sequence[Sequence[str]]) -> list[int]:
        return [self.contains_prefix(keys) for keys in key_lists]

    @abstractmethod
    def get_many(self, keys: Sequence[str]) -> list[bytes | None]: ...

    @abstractmethod
    def put_many(self, items: Sequence[tuple[str, bytes]]) -> list[bool]: ...

    @abstractmethod
    def close(self) -> None: ...

    def contains_many(self, keys: Sequence[str]) -> list[bool] | None:
        return [self.contains_prefix([key]) == 1 for key in keys]

    def epoch(self) -> int:
        return 0

    def available(self) -> bool:
        return True

    def poll(self) -> None:
        return None

    def watch_due(self) -> bool:
        return False

    def watch(self) -> None:
        return None

    def poll_due_in(self) -> float | None:
        return None

    def watch_due_in(self) -> float | None:
        return None

    def stats(self) -> TierStats:
        return TierStats()

    def __enter__(self) -> Tier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# A factory turns a parsed URL into a tier that never raises (see GuardedTier).
TierFactory = Callable[["TierURL"], Tier]

_REGISTRY: dict[str, TierFactory] = {}
# Built-in backends register themselves on import; importing them lazily keeps this module light.
_BUILTIN_MODULES = {
    "memory": "kvcache.memory_tier",
    "redis": "kvcache.redis_tier",
    "rediss": "kvcache.redis_tier",
}


# ``scheme://[user]:password@``: a KV tier (``rediss://user:pw@host``), ``--register``, a response
# store: URLs that go into logs and error messages with their password masked.
_URL_PASSWORD = re.compile(r"(?P<head>\b[a-z][a-z0-9+.-]*://[^/@:\s]*:)[^/@\s]+@", re.IGNORECASE)


def redact_url(text: str) -> str:
    """``text`` with the password of any URL in it masked: ``rediss://user:***@host:6380/0``."""
    return _URL_PASSWORD.sub(r"\g<head>***@", text)


class TierURL:
    """A tier URL split into its parts, with the query parameters the backend consumes.

    Backends ``pop`` the parameters they understand; ``check_consumed`` then rejects any
    left over, so a typo such as ``?tll=60`` is an error at startup instead of silently ignored.
    """

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if not parts.scheme:
            raise ValueError(f"KV tier URL {url!r} has no scheme (expected memory://, redis://, rediss://)")
        self.url = url
        self.scheme = parts.scheme.lower()
        self.parts = parts
        self.params: dict[str, str] = dict(parse_qsl(parts.query, keep_blank_values=True))

    def pop_int(self, name: str, default: int | None, *, minimum: int = 0) -> int | None:
        raw = self.params.pop(name, None)
        if raw is None:
            return default
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"KV tier URL parameter {name}={raw!r} must be an integer") from None
        if value < minimum:
            raise ValueError(f"KV tier URL parameter {name}={value} must be >= {minimum}")
        return value

    def pop_float(self, name: str, default: float, *, minimum: float = 0.0) -> float:
        raw = self.params.pop(name, None)
        if raw is None:
            return default
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"KV tier URL parameter {name}={raw!r} must be a number") from None
        if not value >= minimum:
            raise ValueError(f"KV tier URL parameter {name}={value} must be >= {minimum}")
        return value

    def check_consumed(self) -> None:
        if self.params:
            raise ValueError(
                f"unknown KV tier URL parameter(s) for {self.scheme}://: {', '.join(sorted(self.params))}"
            )

    def url_without_params(self, keep: dict[str, str] | None = None) -> str:
        """The URL with only ``keep`` as its query (for handing to a client library). The values
        were decoded when parsed, so they are encoded again: a ``+``, ``&`` or ``%`` in one (a
        certificate's path, a client name) reaches the library as the user wrote it."""
        query = urlencode(keep or {})
        p = self.parts
        return urlunsplit((p.scheme, p.netloc, p.path, query, p.fragment))


def register_tier(*schemes: str) -> Callable[[TierFactory], TierFactory]:
    """Register a backend factory for one or more URL schemes (adding a backend = a file + this line)."""

    def deco(factory: TierFactory) -> TierFactory:
        for scheme in schemes:
            _REGISTRY[scheme.lower()] = factory
        return factory

    return deco


def open_tier(url: str) -> MeteredTier:
    """Open the tier a URL names, wrapped so that no call ever raises (errors become counted misses).

    Raises ``ValueError`` only for a malformed URL or an unknown scheme/parameter: configuration
    errors belong at startup.
    """
    parsed = TierURL(url)
    if parsed.scheme not in _REGISTRY and parsed.scheme in _BUILTIN_MODULES:
        importlib.import_module(_BUILTIN_MODULES[parsed.scheme])
    factory = _REGISTRY.get(parsed.scheme)
    if factory is None:
        known = sorted(set(_REGISTRY) | set(_BUILTIN_MODULES))
        raise ValueError(f"unknown KV tier scheme {parsed.scheme!r}; known: {', '.join(known)}")
    inner = factory(parsed)
    parsed.check_consumed()
    return MeteredTier(inner)


class MeteredTier(Tier):
    """Outermost wrapper: Prometheus metrics and local counters, and the never-raise guarantee."""

    def __init__(self, inner: Tier) -> None:
        self.inner = inner
        self._lock = threading.Lock()
        self._hits = self._misses = self._bytes_read = self._bytes_written = self._blocks_written = 0
        self._errors = ErrorCounter()

    def contains_prefix(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        try:
            return self.inner.contains_prefix(keys)
        except Exception:
            self._internal_error("contains_prefix")
            return 0

    def contains_prefix_many(self, key_lists: Sequence[Sequence[str]]) -> list[int]:
        if not any(key_lists):
            return [0] * len(key_lists)
        try:
            return self.inner.contains_prefix_many(key_lists)
        except Exception:
            self._internal_error("contains_prefix")
            return [0] * len(key_lists)

    def contains_many(self, keys: Sequence[str]) -> list[bool] | None:
        if not keys:
            return []
        try:
            flags = self.inner.contains_many(keys)
        except Exception:
            self._internal_error("contains_many")
            return None
        if flags is not None and len(flags) != len(keys):
            logger.error("KV tier contains_many answered %d flags for %d keys", len(flags), len(keys))
            self._errors.record(ERROR_INTERNAL)
            return None
        return flags

    def epoch(self) -> int:
        return self.inner.epoch()

    def available(self) -> bool:
        return self.inner.available()

    def poll(self) -> None:
        try:
            self.inner.poll()
        except Exception:
            self._internal_error("poll")

    def poll_due_in(self) -> float | None:
        try:
            return self.inner.poll_due_in()
        except Exception:
            self._internal_error("poll_due_in")
            return None

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """Values as found: each one present counts as a hit. A caller that checks the values
        before using them reads with ``fetch`` and counts with ``count_blocks`` instead."""
        values = self.fetch(keys)
        hits = sum(1 for v in values if v is not None)
        self.count_blocks(hits, len(keys) - hits)
        return values

    def fetch(self, keys: Sequence[str]) -> list[bytes | None]:
        """``get_many`` that leaves hits and misses to the caller (bytes and latency are counted):
        a value that fails its check, or is not used, must not count as a hit."""
        if not keys:
            return []
        start = time.perf_counter()
        try:
            values = self.inner.get_many(keys)
        except Exception:
            self._internal_error("get_many")
            values = [None] * len(keys)
        KV_TIER_GET_SECONDS.observe(time.perf_counter() - start)
        nbytes = sum(len(v) for v in values if v is not None)
        KV_TIER_BYTES_READ.inc(nbytes)
        with self._lock:
            self._bytes_read += nbytes
        return values

    def count_blocks(self, hits: int, misses: int) -> None:
        """Record ``hits`` blocks served and ``misses`` blocks asked for and not served."""
        KV_TIER_HITS.inc(hits)
        KV_TIER_MISSES.inc(misses)
        with self._lock:
            self._hits += hits
            self._misses += misses

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        """The backend's per-item outcome; only the writes it acknowledged count as written."""
        if not items:
            return []
        start = time.perf_counter()
        try:
            stored = self.inner.put_many(items)
        except PartialWriteError as exc:  # a bare backend; a guarded one returns the flags itself
            self._internal_error("put_many")
            stored = exc.stored
        except Exception:
            self._internal_error("put_many")
            stored = [False] * len(items)
        if len(stored) != len(items):  # a backend breaking the contract must not skew the counts
            logger.error("KV tier put_many answered %d flags for %d items", len(stored), len(items))
            self._errors.record(ERROR_INTERNAL)
            stored = [False] * len(items)
        KV_TIER_PUT_SECONDS.observe(time.perf_counter() - start)
        nbytes = sum(len(v) for (_, v), ok in zip(items, stored, strict=True) if ok)
        blocks = sum(stored)
        if blocks:
            KV_TIER_BYTES_WRITTEN.inc(nbytes)
            with self._lock:
                self._bytes_written += nbytes
                self._blocks_written += blocks
        return [bool(ok) for ok in stored]

    def close(self) -> None:
        try:
            self.inner.close()
        except Exception:
            self._internal_error("close")

    def stats(self) -> TierStats:
        inner = self.inner.stats()
        with self._lock:
            return replace(
                inner,
                hits=self._hits,
                misses=self._misses,
                bytes_read=self._bytes_read,
                bytes_written=self._bytes_written,
                blocks_written=self._blocks_written,
                errors=merge_errors(inner.errors, self._errors.snapshot()),
            )

    def _internal_error(self, op: str) -> None:
        logger.exception("KV tier %s failed unexpectedly; treated as a miss", op)
        self._errors.record(ERROR_INTERNAL)
        note_unanswered()
