"""Prefill/decode disaggregation settings of `ferry router` (flags, frozen config, metrics).

The PD orchestration itself lives in ``router/pd.py``; this module is what ``router/args.py``
and ``router/main.py`` need (torch-free, no I/O).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram

from router.policies.registry import POLICY_NAMES

_PD_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


@dataclass(frozen=True)
class PDConfig:
    prefill_policy: str = "cache_aware"
    decode_policy: str = "least_load"
    # Prompts whose uncached part is shorter than this are prefilled on the decode worker: the
    # hand-off (one extra request, a tier write and read) costs more than computing them there.
    pd_threshold: int = 64
    prefill_timeout: float = 60.0  # seconds without an answer from a prefill worker
    # A prefill worker with this many requests in flight is saturated; when every one is, the
    # decode worker prefills locally rather than queueing behind them.
    prefill_max_inflight: int = 8

    def __post_init__(self) -> None:
        for name in (self.prefill_policy, self.decode_policy):
            if name not in POLICY_NAMES:
                raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICY_NAMES)}")
        if self.pd_threshold < 0 or self.prefill_timeout <= 0 or self.prefill_max_inflight < 1:
            raise ValueError("--pd-threshold >= 0, --prefill-timeout > 0 and --prefill-max-inflight >= 1")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> PDConfig:
        return cls(
            prefill_policy=args.prefill_policy,
            decode_policy=args.decode_policy,
            pd_threshold=args.pd_threshold,
            prefill_timeout=args.prefill_timeout,
            prefill_max_inflight=args.prefill_max_inflight,
        )


def add_pd_args(p: argparse.ArgumentParser) -> None:
    d = PDConfig()
    g = p.add_argument_group("prefill/decode disaggregation (with --prefill and --decode pools)")
    g.add_argument("--prefill-policy", choices=list(POLICY_NAMES), default=d.prefill_policy)
    g.add_argument("--decode-policy", choices=list(POLICY_NAMES), default=d.decode_policy)
    g.add_argument(
        "--pd-threshold",
        type=int,
        default=d.pd_threshold,
        help="uncached prompt tokens below which a request is not disaggregated (a mixed replica serves it, else the decode worker prefills it)",
    )
    g.add_argument(
        "--prefill-timeout",
        type=float,
        default=d.prefill_timeout,
        help="seconds a prefill worker may take; then another one, then local prefill",
    )
    g.add_argument(
        "--prefill-max-inflight",
        type=int,
        default=d.prefill_max_inflight,
        help="in-flight requests at which a prefill worker counts as saturated",
    )


class PDMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "ferry:router_pd_requests",
            "Requests served with prefill/decode pools, by path (disaggregated; mixed: whole on a mixed "
            "replica; local_prefill: whole on a decode worker)",
            ["path"],
            registry=registry,
        )
        self.prefill_latency = Histogram(
            "ferry:router_pd_prefill_seconds",
            "Prefill step of a disaggregated request (send to first token back)",
            buckets=_PD_BUCKETS,
            registry=registry,
        )
        self.decode_latency = Histogram(
            "ferry:router_pd_decode_seconds",
            "Decode step of a disaggregated request (hand-off to the last token)",
            buckets=_PD_BUCKETS,
            registry=registry,
        )
        self.fallbacks = Counter(
            "ferry:router_pd_local_prefill",
            "Requests not disaggregated (served whole by a mixed replica, else by a decode worker), by reason",
            ["reason"],
            registry=registry,
        )
