"""cache_aware: send a request where most of its prompt is already in the KV cache, within limits.

Score of a candidate = prompt tokens it would not have to compute (its longest held prefix of
the request's block hashes, times the block size) minus ``load_penalty_tokens`` per request it has
that is still waiting for its first token (queued or in prefill: the work a new request waits
behind) and ``decode_penalty_tokens`` per request past it (decoding, which a new prefill shares
steps with but does not queue behind). The best score wins; ties rotate. A hot prefix must not
pile every request onto its holder, so a load guard overrides the score: when the chosen replica
has more than ``balance_abs_threshold`` requests in flight beyond the least loaded candidate, the
least loaded one (most cached among equals) gets the request instead, and then holds that prefix too.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.policies.base import Policy, RouteRequest, TieBreaker, load_key
from router.prefix_index import PrefixIndex
from router.replica import Replica


class CacheAware(Policy):
    name = "cache_aware"
    needs_prefix = True

    def __init__(
        self,
        *,
        block_size: int = 16,
        balance_abs_threshold: int = 16,
        load_penalty_tokens: int = 64,
        decode_penalty_tokens: int = 0,
        prefix_index_size: int = 1 << 18,
        index: PrefixIndex | None = None,
    ) -> None:
        self.block_size = block_size
        self.balance_abs_threshold = balance_abs_threshold
        self.load_penalty_tokens = load_penalty_tokens
        self.decode_penalty_tokens = decode_penalty_tokens
        self.index = index if index is not None else PrefixIndex(prefix_index_size)
        self.ties = TieBreaker()

    def choose(self, req: RouteRequest, candidates: Sequence[Replica]) -> Replica:
        matched = self.index.match(req.block_hashes, [r.url for r in candidates])
        bs, waiting, decoding = self.block_size, self.load_penalty_tokens, self.decode_penalty_tokens

        def score(r: Replica) -> int:
            return matched[r.url] * bs - waiting * r.prefilling - decoding * (r.inflight - r.prefilling)

        best_score = max(score(r) for r in candidates)
        tied = [r for r in candidates if score(r) == best_score]
        best = tied[0] if len(tied) == 1 else self.ties.pick(tied)

        min_inflight = min(r.inflight for r in candidates)
        if best.inflight - min_inflight > self.balance_abs_threshold:
            # Load guard: among the least loaded, prefer the one holding the most.
            light = min(load_key(r) for r in candidates)
            lightest = [r for r in candidates if load_key(r) == light]
            most = max(matched[r.url] for r in lightest)
            lightest = [r for r in lightest if matched[r.url] == most]
            best = lightest[0] if len(lightest) == 1 else self.ties.pick(lightest)
        req.predicted_hit_tokens = matched[best.url] * bs
        return best

    def on_routed(self, req: RouteRequest, replica: Replica) -> None:
        if req.block_hashes:
            self.index.insert(req.block_hashes, replica.url)

    def on_replica_removed(self, url: str) -> None:
        self.index.drop_replica(url)

    def on_cache_lost(self, url: str) -> None:
        self.index.drop_replica(url)
