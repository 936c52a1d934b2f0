"""The router's Prometheus metrics (``ferry:router_*``), in a registry of its own.

One ``RouterMetrics`` per router, so several routers in one process (tests) never clash.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from router.kv_events import GAP_REASONS as KV_EVENT_GAP_REASONS
from router.kv_events import OUTCOMES as KV_EVENT_OUTCOMES
from server.metrics_exposition import exposition

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

# How a request ended, the ``outcome`` of ``ferry:router_request_latency_seconds``:
# ok: answered to the end with a status below 500 (a client's 4xx included);
# error: a 5xx answer, or one the router could not finish (a forwarded body cut off, a stream it
#   ended with an error event because its replica failed and no other could resume it);
# client_gone: the client disconnected first (the time until it left).
OUTCOMES = ("ok", "error", "client_gone")
# ``op`` of ``ferry:router_lora_failures_total``: a client's load/unload fanned out, a restore, or
# an adoption refused because replicas list one adapter name under different paths (a conflict).
LORA_OPS = ("load", "unload", "restore", "adopt")


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.requests = Counter(
            "ferry:router_requests",
            "Requests relayed, by replica and final status",
            ["replica", "status"],
            registry=r,
        )
        # Every request the router admitted, once, however it ended (``OUTCOMES``): a dashboard's
        # `sum by (le)` sees them all; `outcome="ok"` selects the answered ones.
        self.latency = Histogram(
            "ferry:router_request_latency_seconds",
            "End-to-end latency through the router, by how the request ended",
            ["outcome"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "ferry:router_ttft_seconds",
            "Time to the first streamed content byte",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.retries = Counter(
            "ferry:router_retries", "Re-sends to another replica before any byte", registry=r
        )
        self.failovers = Counter("ferry:router_failovers", "Streams resumed on another replica", registry=r)
        self.healthy = Gauge(
            "ferry:router_replica_healthy", "1 when the replica takes traffic", ["replica"], registry=r
        )
        self.inflight = Gauge(
            "ferry:router_inflight", "Requests in flight per replica", ["replica"], registry=r
        )
        self.cache_hit_tokens = Counter(
            "ferry:router_cache_hit_tokens",
            "Prompt tokens predicted cached at the chosen replica (cache_aware)",
            registry=r,
        )
        self.rejected = Counter(
            "ferry:router_rejected", "Requests refused by overload control (429)", registry=r
        )
        # Requests naming a stored response (previous_response_id, /v1/responses/{id}) or stored
        # items (input item_reference): "hit" when sent to the replica that holds it, "miss" when this router does not know it or that
        # replica cannot take traffic (router/response_affinity.py).
        self.response_affinity = Counter(
            "ferry:router_response_affinity",
            "Requests naming a stored response or item, by outcome",
            ["outcome"],
            registry=r,
        )
        # What became of the replicas' KV block events the router read (router/kv_events.py; all
        # at 0 without a Redis --kv-tier and cache_aware: nothing is read then).
        self.kv_events = Counter(
            "ferry:router_kv_events",
            "Replicas' KV block events read by the router, by what became of them.",
            ["outcome"],
            registry=r,
        )
        for outcome in KV_EVENT_OUTCOMES:  # at 0 from the start: a first increase shows in rate()
            self.kv_events.labels(outcome)
        # Events the router missed, by how it learned (router/kv_events.py: a publisher's numbers
        # jumped, the stream was trimmed past what it had read, or the stream was recreated):
        # each drops the replicas concerned from the prefix index until their next events.
        self.kv_event_gaps = Counter(
            "ferry:router_kv_event_gaps",
            "Gaps in the replicas' KV block events the router read, by how it saw them.",
            ["reason"],
            registry=r,
        )
        for reason in KV_EVENT_GAP_REASONS:
            self.kv_event_gaps.labels(reason)
        # Replicas that failed a LoRA adapter change the router fanned out (router/lora_admin.py):
        # a client's load or unload, or the router's own restore of a remembered adapter onto a
        # replica that joined or restarted; ``adopt``: an adapter name the replicas list under
        # different paths, which the router therefore did not adopt (router/lora_learn.py).
        self.lora_failures = Counter(
            "ferry:router_lora_failures",
            "Replicas that failed a LoRA adapter load or unload sent by the router, by operation",
            ["op"],
            registry=r,
        )
        for op in LORA_OPS:
            self.lora_failures.labels(op)

        # Label children cached: ``labels()`` costs a lock and a dict build on every call. Every
        # outcome is exposed from the start, at 0, so a rate() over one not seen yet reads 0.
        self._inflight: dict[str, Gauge] = {}
        self._requests: dict[tuple[str, str], Counter] = {}
        self._latency = {outcome: self.latency.labels(outcome) for outcome in OUTCOMES}

    def observe_latency(self, seconds: float, outcome: str) -> None:
        """One admitted request's time from arrival to its end, by ``outcome`` (``OUTCOMES``)."""
        self._latency[outcome].observe(seconds)

    def inflight_of(self, url: str) -> Gauge:
        child = self._inflight.get(url)
        if child is None:
            child = self._inflight[url] = self.inflight.labels(url)
        return child

    def requests_of(self, url: str, status: str) -> Counter:
        child = self._requests.get((url, status))
        if child is None:
            child = self._requests[(url, status)] = self.requests.labels(url, status)
        return child

    def forget_replica(self, url: str) -> None:
        self._inflight.pop(url, None)
        for gauge in (self.healthy, self.inflight):
            try:
                gauge.remove(url)
            except KeyError:
                pass

    def exposition(self, accept: str | None) -> tuple[bytes, str]:
        """``/metrics``: in the format the scrape's ``Accept`` asks for, and its content type."""
        return exposition(self.registry, accept)
