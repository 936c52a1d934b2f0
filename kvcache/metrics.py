"""Prometheus collectors of the KV tier, plus the process-local counters behind ``Tier.stats()``.

The collectors live on prometheus-client's default registry at module level, so a replica's
``/metrics`` shows them without any wiring. Counters are declared without the ``_total``
suffix because prometheus-client appends it: the exposed names are exactly
``ferry:kv_tier_hits_total`` and so on. Nothing here imports torch.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from prometheus_client import Counter, Histogram

# Error kinds used as the ``kind`` label of ferry:kv_tier_errors_total.
ERROR_CONNECTION = "connection"  # refused, reset, DNS, TLS: the tier is unreachable
ERROR_TIMEOUT = "timeout"  # a socket timeout bounded the call
ERROR_CORRUPT = "corrupt"  # a stored value is damaged: truncated, bad magic, failed checksum
# An intact stored value that is not the block asked for: its header names another model
# fingerprint, dtype, shape, block or format version (refused, never loaded).
ERROR_MISMATCH = "mismatch"
ERROR_RESPONSE = "response"  # the server answered with an error (OOM, READONLY, auth…)
ERROR_CIRCUIT_OPEN = "circuit_open"  # call skipped: the breaker is open after recent failures
ERROR_INTERNAL = "internal"  # anything else; a bug if it ever shows up
# Why a block write was dropped: the ``reason`` label of ferry:kv_tier_dropped_writes_total.
DROP_QUEUE_FULL = "queue_full"  # the write queue was full when the block filled
DROP_TIER = "tier"  # the tier refused or lost the write (down, full, timed out, broken off)
DROP_ENCODE = "encode"  # the block could not be encoded
DROP_SNAPSHOT = "snapshot"  # copying the block off the device failed
DROP_CLOSED = "closed"  # the writer closed first, or gave up on it at close's timeout
# The server answered the write with a refusal (the breaker stays closed: it is reachable). The first
# three pass (memory freed, a primary back, a save that works again): their blocks are written again
# later (``kvcache/writer.py``, with a back-off); ``refused`` (an ACL's NOPERM, anything else) is not
# expected to pass by itself and is only counted.
DROP_OOM = "oom"  # over ``maxmemory`` under ``noeviction`` ("OOM command not allowed")
DROP_READONLY = "readonly"  # a read-only replica ("READONLY"), e.g. the old primary after a failover
DROP_MISCONF = "misconf"  # writes stopped because RDB saves fail ("MISCONF", stop-writes-on-bgsave-error)
DROP_REFUSED = "refused"  # any other refusal (NOPERM from an ACL, ...)
DROP_RETRYABLE = (DROP_OOM, DROP_READONLY, DROP_MISCONF)
DROP_REASONS = (
    DROP_QUEUE_FULL,
    DROP_TIER,
    DROP_ENCODE,
    DROP_SNAPSHOT,
    DROP_CLOSED,
    DROP_OOM,
    DROP_READONLY,
    DROP_MISCONF,
    DROP_REFUSED,
)
ERROR_KINDS = (
    ERROR_CONNECTION,
    ERROR_TIMEOUT,
    ERROR_CORRUPT,
    ERROR_MISMATCH,
    ERROR_RESPONSE,
    ERROR_CIRCUIT_OPEN,
    ERROR_INTERNAL,
)

_LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)

KV_TIER_HITS = Counter("ferry:kv_tier_hits", "KV blocks read from the tier and used (found intact).")
KV_TIER_MISSES = Counter(
    "ferry:kv_tier_misses", "KV blocks asked of the tier and not used (absent, corrupt, or after either)."
)
KV_TIER_BYTES_READ = Counter("ferry:kv_tier_bytes_read", "Bytes of KV block values read from the tier.")
KV_TIER_BYTES_WRITTEN = Counter(
    "ferry:kv_tier_bytes_written", "Bytes of KV block values the tier acknowledged writing."
)
KV_TIER_ERRORS = Counter("ferry:kv_tier_errors", "Tier calls or values that failed, by kind.", ["kind"])
# Every kind exposed from the start at 0: a series that first appears at 1 shows no increase to
# rate(), so a replica's first tier error would never reach a dashboard or an alert.
for _kind in ERROR_KINDS:
    KV_TIER_ERRORS.labels(kind=_kind)
KV_TIER_DROPPED_WRITES = Counter(
    "ferry:kv_tier_dropped_writes",
    "KV block writes dropped, by reason: the write queue was full, the tier did not acknowledge the "
    "block (down, timed out: tier; refused by the server: oom, readonly, misconf, refused), the block "
    "did not encode or snapshot, or the writer closed first.",
    ["reason"],
)
for _reason in DROP_REASONS:
    KV_TIER_DROPPED_WRITES.labels(reason=_reason)
KV_TIER_REPUBLISHED = Counter(
    "ferry:kv_tier_republished_blocks",
    "KV blocks of the local prefix cache written to the tier again after it came back (a breaker "
    "closing, a Redis restart) because it lacked them; counted once the tier acknowledged each.",
)
KV_TIER_GET_SECONDS = Histogram(
    "ferry:kv_tier_get_seconds", "Latency of one batched tier read (get_many).", buckets=_LATENCY_BUCKETS
)
KV_TIER_PUT_SECONDS = Histogram(
    "ferry:kv_tier_put_seconds", "Latency of one batched tier write (put_many).", buckets=_LATENCY_BUCKETS
)


@dataclass(frozen=True)
class TierStats:
    """A snapshot of one tier instance's counters (the Prometheus ones add up every instance)."""

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    blocks_written: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    # Filled by the backends that know them.
    entries: int | None = None
    bytes_used: int | None = None
    capacity_bytes: int | None = None
    evictions: int | None = None
    breaker_state: str | None = None


class ErrorCounter:
    """Counts errors by kind locally and in ``ferry:kv_tier_errors_total``; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def record(self, kind: str, n: int = 1) -> None:
        KV_TIER_ERRORS.labels(kind=kind).inc(n)
        with self._lock:
            self._counts[kind] = self._counts.get(kind, 0) + n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


def merge_errors(*parts: dict[str, int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in parts:
        for kind, n in part.items():
            out[kind] = out.get(kind, 0) + n
    return out
