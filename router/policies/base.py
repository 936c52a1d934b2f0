"""The policy interface: pick one replica out of the routable candidates for a request.

Policies are synchronous and cheap (they run on the event loop for every request and every
retry) and never do I/O. They read the load the router tracks on each ``Replica``
(``inflight``, ``inflight_tokens``, ``prefilling``); the relay updates those counters, not the policy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

from router.replica import Replica


@dataclass
class RouteRequest:
    """What a policy may look at. ``block_hashes`` is filled only for policies that need a prefix."""

    request_id: str
    session_key: str | None = None
    prompt_tokens: int = 0  # exact when the router tokenized, else an estimate from the body size
    block_hashes: list[bytes] = field(default_factory=list)
    predicted_hit_tokens: int = 0  # set by cache_aware: prompt tokens the chosen replica should hold
    # The replica to use while it is a candidate, whatever the policy says (the one holding the
    # stored response a Responses API request names: router/response_affinity.py).
    prefer_url: str | None = None
    model: str | None = None  # the body's ``model``: replicas that list it are preferred (pool.serving)


class Policy(ABC):
    name: str = ""
    needs_prefix: bool = False  # the relay computes RouteRequest.block_hashes only when True

    @abstractmethod
    def choose(self, req: RouteRequest, candidates: Sequence[Replica]) -> Replica:
        """Pick one of ``candidates`` (non-empty, in the pool's stable order)."""

    def on_routed(self, req: RouteRequest, replica: Replica) -> None:  # noqa: B027 - optional hook
        """``replica`` was chosen for the request (called before it is sent, so concurrent requests
        see it; a replica that then fails simply holds less than the policy believes)."""

    def on_replica_removed(self, url: str) -> None:  # noqa: B027 - optional hook
        """Forget whatever the policy remembers about ``url``."""

    def on_cache_lost(self, url: str) -> None:  # noqa: B027 - optional hook
        """``url`` holds no KV blocks now (it restarted, or dropped its prefix cache)."""


def load_key(r: Replica) -> tuple[int, int]:
    """Ordering of replicas by the load the router tracks: requests first, then tokens."""
    return (r.inflight, r.inflight_tokens)


class TieBreaker:
    """Rotates among equally good replicas so ties spread instead of piling on the first."""

    def __init__(self) -> None:
        self.counter = 0

    def pick(self, tied: Sequence[Replica]) -> Replica:
        self.counter += 1
        return tied[self.counter % len(tied)]
