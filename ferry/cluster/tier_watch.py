"""The KV tier of a `ferry up` cluster, checked: one PING (``ping_tier``) at start, and every few
seconds once the cluster runs (``TierWatcher``), so a tier that goes away after the start, or comes
back, is said and shows in the state file.

It must never stop or restart anything itself: workers serve on without the tier (they recompute
what they would have loaded); a child redis-server that exits is restarted by the supervisor as any
other child is, and one that leaves ``HUNG_AFTER`` PINGs in a row unanswered while its process runs
(stopped, stuck on a disk) is killed by the supervisor so that it restarts (never an existing tier:
not ours to kill). Its PINGs run on a thread of their own, each on a fresh connection bounded by a
timeout, so a tier that hangs never holds up the supervisor's loop; that thread only records what
it saw, and the supervisor's main thread decides what to say and do.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

REDIS_SCHEMES = ("redis://", "rediss://")
CHECK_INTERVAL_S = 5.0  # default seconds between PINGs (`ferry up --kv-tier-check-interval`)
CHECK_TIMEOUT_S = 2.0  # connect and answer timeout of each PING of a running cluster's tier
# Unanswered PINGs in a row after which `ferry up`'s own redis-server, still running, counts as hung
# and is killed to be restarted (a Kubernetes liveness probe's failureThreshold, 3 there too). With
# the defaults that is about 3 x (5 + 2) s = 21 s of silence.
HUNG_AFTER = 3


@dataclass(frozen=True)
class TierCheck:
    """What one PING found: ``ok``, else ``problem`` (``cannot reach`` / ``cannot log in to``) and
    ``reason`` (redis-py's words, any password in them masked)."""

    ok: bool
    problem: str | None = None
    reason: str | None = None


def is_redis_url(url: str | None) -> bool:
    return bool(url) and url.startswith(REDIS_SCHEMES)


def ping_tier(url: str, timeout_s: float) -> TierCheck:
    """PING the Redis tier at ``url`` on a new connection, with connect and answer timeouts of
    ``timeout_s`` and no retries."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from kvcache.redis_tier import client_url
    from kvcache.tier import redact_url

    problem = "cannot reach"
    try:
        client = redis.Redis.from_url(
            client_url(url),
            socket_connect_timeout=timeout_s,
            socket_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        with client:
            client.ping()
        return TierCheck(True)
    except redis.exceptions.AuthenticationError as e:
        problem, error = "cannot log in to", e
    except (redis.exceptions.RedisError, OSError, ValueError, TypeError) as e:
        error = e
    reason = redact_url(str(error)).rstrip(".") or type(error).__name__
    return TierCheck(False, problem, reason)


class TierWatcher:
    """PINGs ``url`` every ``interval_s`` seconds (after the previous answer or timeout) on a daemon
    thread; ``latest()`` is the last result (None before the first)."""

    def __init__(self, url: str, interval_s: float, timeout_s: float) -> None:
        self.url = url
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._latest: TierCheck | None = None
        # When each of the last PINGs left unanswered was sent (monotonic), oldest first; emptied by
        # any other answer, so these are the latest PINGs and none answered.
        self._unanswered: deque[float] = deque(maxlen=HUNG_AFTER)
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-tier-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def latest(self) -> TierCheck | None:
        with self._lock:
            return self._latest

    def unanswered_since(self, since: float) -> int:
        """How many of the latest PINGs, all sent at or after ``since`` (monotonic), the tier left
        unanswered in a row (``cannot reach``: a refused password is an answer), at most
        ``HUNG_AFTER``. PINGs sent before ``since`` (a process since restarted) do not count."""
        with self._lock:
            return sum(1 for sent in self._unanswered if sent >= since)

    def stop(self) -> None:
        """Ask the thread to end; not waited for (a PING may be sitting out its timeout, and the
        thread holds nothing that needs cleaning up)."""
        self._stopped.set()

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_s):
            sent = time.monotonic()
            check = ping_tier(self.url, self.timeout_s)
            with self._lock:
                self._latest = check
                if check.ok or check.problem != "cannot reach":
                    self._unanswered.clear()
                else:
                    self._unanswered.append(sent)
