"""round_robin: replicas in turn, in the pool's order (exact distribution when the set is stable)."""

from __future__ import annotations

from collections.abc import Sequence

from router.policies.base import Policy, RouteRequest
from router.replica import Replica


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self.next = 0

    def choose(self, req: RouteRequest, candidates: Sequence[Replica]) -> Replica:
        r = candidates[self.next % len(candidates)]
        self.next += 1
        return r
