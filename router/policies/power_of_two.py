"""power_of_two: two random candidates, the less loaded one wins (cheap, no herd on one replica)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from router.policies.base import Policy, RouteRequest, load_key
from router.replica import Replica


class PowerOfTwo(Policy):
    name = "power_of_two"

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def choose(self, req: RouteRequest, candidates: Sequence[Replica]) -> Replica:
        if len(candidates) == 1:
            return candidates[0]
        a, b = self.rng.sample(range(len(candidates)), 2)
        ra, rb = candidates[a], candidates[b]
        return rb if load_key(rb) < load_key(ra) else ra
