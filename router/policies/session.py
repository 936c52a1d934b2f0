"""session: the same session key always reaches the same replica (rendezvous hashing).

The key is the ``X-Session-Id`` header, else the request's ``user`` field. Each replica scores
``blake2b(key, url)`` and the highest score wins, so when a replica leaves only the sessions it
held move (each to its own second choice) and when one joins it takes only the sessions it now
wins: the minimal movement consistent hashing promises, without a ring to rebuild. Requests with
no key go to the least loaded replica.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from router.policies.base import Policy, RouteRequest, TieBreaker
from router.policies.least_load import least_loaded
from router.replica import Replica


def rendezvous_score(key: str, url: str) -> int:
    h = hashlib.blake2b(url.encode() + b"\x00" + key.encode(), digest_size=8)
    return int.from_bytes(h.digest(), "big")


def rendezvous_pick(key: str, urls: Sequence[str]) -> str:
    return max(urls, key=lambda u: (rendezvous_score(key, u), u))


class Session(Policy):
    name = "session"

    def __init__(self) -> None:
        self.ties = TieBreaker()

    def choose(self, req: RouteRequest, candidates: Sequence[Replica]) -> Replica:
        if not req.session_key:
            return least_loaded(candidates, self.ties)
        key = req.session_key
        return max(candidates, key=lambda r: (rendezvous_score(key, r.url), r.url))
