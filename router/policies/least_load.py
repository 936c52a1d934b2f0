"""least_load: the replica with the fewest in-flight requests (then tokens) the router tracks."""

from __future__ import annotations

from collections.abc import Sequence

from router.policies.base import Policy, RouteRequest, TieBreaker, load_key
from router.replica import Replica


class LeastLoad(Policy):
    name = "least_load"

    def __init__(self) -> None:
        self.ties = TieBreaker()

    def choose(self, req: RouteRequest, candidates: Sequence[Replica]) -> Replica:
        return least_loaded(candidates, self.ties)


def least_loaded(candidates: Sequence[Replica], ties: TieBreaker) -> Replica:
    best = min(load_key(r) for r in candidates)
    tied = [r for r in candidates if load_key(r) == best]
    return tied[0] if len(tied) == 1 else ties.pick(tied)
