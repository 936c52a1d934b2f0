"""When to retry and how long to wait: a pure, tested policy (the relay applies it).

A request may be re-sent to a *different* replica only while no byte of the answer has reached
the client: after connect errors (nothing listens), read errors before the response head, and
answers 429/502/503/504 (the replica is overloaded, draining or broken), and 529, the Messages
API's word for a replica's 429 or 503 (Anthropic's ``overloaded_error``). Any other status is the
answer, and so is a 504 that is a replica's own request timeout (``request_timed_out``). Backoff
is "full jitter": uniform in [0, min(cap, base * 2**attempt)], so retries of many requests that
failed together do not arrive together.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from server.anthropic_protocol import REQUEST_TIMEOUT_HEADER, TIMED_OUT

if TYPE_CHECKING:
    from router.upstream import Headers

RETRYABLE_STATUS = frozenset({429, 502, 503, 504, 529})
# Anthropic's overloaded_error: a replica's full queue or its 503, which the router cannot tell
# apart; counted as load, as 429 is (a replica that is down fails its health checks).
OVERLOADED = 529


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = 2
    backoff_base: float = 0.02
    backoff_cap: float = 0.5

    def should_retry_status(self, status: int, attempt: int) -> bool:
        return status in RETRYABLE_STATUS and attempt < self.max_retries

    def can_retry(self, attempt: int) -> bool:
        return attempt < self.max_retries

    def backoff(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry number ``attempt + 1`` (attempt counts from 0)."""
        ceiling = min(self.backoff_cap, self.backoff_base * (2**attempt))
        return (rng or random).uniform(0.0, ceiling)


def counts_as_replica_failure(status: int) -> bool:
    """Statuses that feed the replica's circuit breaker (429 and 529 are load, not failure)."""
    return status >= 500 and status != OVERLOADED


def request_timed_out(status: int, headers: Headers) -> bool:
    """A replica's answer that its request ran past its ``--request-timeout``: the Messages API's
    504 ``timeout_error``, marked as the request's own (not a gateway's 504). It is the answer, as
    the other APIs' 408 is: another replica would run the request as long again, and the replica
    that answered it is well."""
    return status == TIMED_OUT and headers.get(REQUEST_TIMEOUT_HEADER) is not None
