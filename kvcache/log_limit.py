"""Log lines about single requests (retries, failovers, KV blocks a producer could not write), kept
to a rate a log can take.

A replica that dies under load makes every request it held retry or fail over at once; a KV tier
that is down makes every prefill worker's request report a shortfall: one line each would bury the
lines that say what happened. ``RateLimitedLog`` writes at most ``burst`` lines per ``window``
seconds and says, in the first line after a quiet spell, how many it left out. Events of replicas
(ejected, readmitted, circuit opened) and of the tier (circuit breaker opened, closed) are few and
are logged as they happen. It lives here, the lowest part that logs per request, so that the router
(``router/log_limit.py``) and the KV connector share it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class RateLimitedLog:
    def __init__(
        self,
        logger: logging.Logger,
        *,
        burst: int = 10,
        window: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.burst = burst
        self.window = window
        self.clock = clock
        self._window_start = float("-inf")
        self._written = 0
        self.dropped = 0  # lines left out since the last one written

    def warning(self, message: str, *args: object) -> None:
        now = self.clock()
        if now - self._window_start >= self.window:
            self._window_start, self._written = now, 0
        if self._written >= self.burst:
            self.dropped += 1
            return
        self._written += 1
        if self.dropped:
            message += " (%d similar lines left out)"
            args = (*args, self.dropped)
            self.dropped = 0
        self.logger.warning(message, *args)
