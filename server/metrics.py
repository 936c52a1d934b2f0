"""Prometheus metrics of one replica, named as vLLM names them so existing dashboards work.

Two kinds:
* gauges and counters that mirror engine state (running/waiting requests, KV usage, prefix-cache
  queries/hits, preemptions) are read from ``engine.stats()`` at scrape time by a custom
  collector (``server/engine_stats_metrics.py``), never pushed per token;
* per-request histograms (TTFT, inter-token latency, end-to-end latency, queue time; when a
  request finishes: its prompt and generation tokens, prefill, decode and inference time, time
  per output token) and finished requests by reason are observed by the serving layer as
  outputs arrive. vLLM's stock Grafana dashboard reads these.

Counts per engine request (one choice) that generated n tokens (ARCHITECTURE.md, "Metrics"):
TTFT 1 (n >= 1); ``vllm:inter_token_latency_seconds`` and its deprecated vLLM alias
``vllm:time_per_output_token_seconds`` exactly n - 1 (a delta of k tokens read t s after the last
is k gaps of t / k; the tokens that came with the first are gaps of 0); vLLM's per-request
``vllm:request_time_per_output_token_seconds`` 1 when it finished with n >= 2. Every request that
ran ends once in ``request_success`` (an abort before its last output: ``abort``, with the
tokens received; a stop the server chose, a Responses answer capped by ``max_tool_calls``: ``stop``), e2e latency and the prompt and generation token histograms; one the engine
refused (a 400) is not counted. ``vllm:request_max_num_generation_tokens`` counts once per prompt
of a request (its choices' longest), when all its counted choices have ended.

Every series carries ``model_name``; vLLM's (``vllm:*``, but ``vllm:lora_requests_info``) also
``engine``, the engine's index, as vLLM v1 labels them: "0", a replica running one engine.
prometheus-client appends ``_total`` to counters, so the
exposed names are ``vllm:prompt_tokens_total``, ``vllm:prefix_cache_hits_total`` … exactly as
vLLM v1 exposes them. The serving metrics live in a registry of their own (two apps in one
process never collide); ``/metrics`` renders it together with the process-wide default
registry, where the KV tier registers its ``ferry:`` metrics.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.multiprocess import MultiProcessCollector

from server.engine_stats_metrics import ENGINE_INDEX, EngineStatsCollector
from server.metrics_exposition import Collectors, exposition
from server.tracing import Phases, phases_of

# Bucket edges in seconds (the spread vLLM uses: sub-ms to minutes).
_TTFT_BUCKETS = tuple(
    float(x)
    for x in "0.001 0.005 0.01 0.02 0.04 0.06 0.08 0.1 0.25 0.5 0.75 1 2.5 5 7.5 10 20 40 80 160 640 2560".split()
)
_ITL_BUCKETS = tuple(
    float(x)
    for x in "0.001 0.0025 0.005 0.01 0.025 0.05 0.075 0.1 0.15 0.2 0.3 0.4 0.5 0.75 1 2.5 5 7.5 10 20 40 80".split()
)
_REQUEST_BUCKETS = tuple(
    float(x)
    for x in "0.01 0.05 0.1 0.3 0.5 0.8 1 1.5 2 2.5 5 10 15 20 30 40 50 60 120 240 480 960 1920 7680".split()
)

_TPOT_BUCKETS = tuple(
    float(x) for x in "0.01 0.025 0.05 0.075 0.1 0.15 0.2 0.3 0.4 0.5 0.75 1 2.5 5 7.5 10 20 40 80".split()
)
# Token counts: 1, 2, 5 times powers of ten up to a million (vLLM's build_1_2_5_buckets).
_TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5) if m * 10**e <= 1_000_000)

# The engine's finish reasons (vLLM's FinishReason values).
_FINISH_REASONS = ("stop", "length", "abort")


class ServerMetrics:
    """The serving layer's metrics for one served model, in a registry of its own."""

    def __init__(
        self,
        model_name: str,
        engine_stats: Callable[[], Any] | None = None,
        max_loras: int | None = None,
        cache_info: Mapping[str, str] | None = None,
    ) -> None:
        """``max_loras``: LoRA adapters are served (``vllm:lora_requests_info`` is exposed);
        ``cache_info``: the KV cache's configuration (``vllm:cache_config_info``)."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        labels = ["model_name"]
        # vLLM's series carry the engine's index beside the model (one engine per replica: "0").
        vllm_labels = ["model_name", "engine"]
        ours = (model_name, ENGINE_INDEX)
        reg = self.registry
        self._success = Counter(
            "vllm:request_success",
            "Count of finished requests.",
            vllm_labels + ["finished_reason"],
            registry=reg,
        )
        # Every finish reason exposed from the start at 0, as vLLM does: a rate() over a reason
        # that has not happened yet reads 0, not "no data".
        self._success_by_reason: dict[str, Counter] = {
            reason: self._success.labels(*ours, reason) for reason in _FINISH_REASONS
        }
        self._ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            vllm_labels,
            buckets=_TTFT_BUCKETS,
            registry=reg,
        ).labels(*ours)
        self._itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            vllm_labels,
            buckets=_ITL_BUCKETS,
            registry=reg,
        ).labels(*ours)
        self._e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds.",
            vllm_labels,
            buckets=_REQUEST_BUCKETS,
            registry=reg,
        ).labels(*ours)
        self._queue = Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            vllm_labels,
            buckets=_REQUEST_BUCKETS,
            registry=reg,
        ).labels(*ours)
        self._prompt_tokens = Histogram(
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            vllm_labels,
            buckets=_TOKEN_BUCKETS,
            registry=reg,
        ).labels(*ours)
        self._generation_tokens = Histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            vllm_labels,
            buckets=_TOKEN_BUCKETS,
            registry=reg,
        ).labels(*ours)
        self._max_generation_tokens = Histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            vllm_labels,
            buckets=_TOKEN_BUCKETS,
            registry=reg,
        ).labels(*ours)
        self._prefill = Histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            vllm_labels,
            buckets=_REQUEST_BUCKETS,
            registry=reg,
        ).labels(*ours)
        self._decode = Histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            vllm_labels,
            buckets=_REQUEST_BUCKETS,
            registry=reg,
        ).labels(*ours)
        self._inference = Histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            vllm_labels,
            buckets=_REQUEST_BUCKETS,
            registry=reg,
        ).labels(*ours)
        # vLLM's deprecated name of the inter-token latency: the same samples, its own buckets.
        self._tpot = Histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds. "
            "DEPRECATED: Use vllm:inter_token_latency_seconds instead.",
            vllm_labels,
            buckets=_TPOT_BUCKETS,
            registry=reg,
        ).labels(*ours)
        self._request_tpot = Histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            vllm_labels,
            buckets=_TPOT_BUCKETS,
            registry=reg,
        ).labels(*ours)
        self.rejected = Counter(
            "ferry:server_rejected_requests",
            "Requests refused by admission control (429).",
            labels,
            registry=reg,
        ).labels(model_name)
        self.structured_outputs_too_costly = Counter(
            "ferry:structured_outputs_too_costly",
            "Requests ended because their structured-outputs grammar cost the engine thread more than "
            "--structured-outputs-mask-budget-ms a token (each also counted as an abort).",
            labels,
            registry=reg,
        ).labels(model_name)
        self.structured_outputs_dead_end = Counter(
            "ferry:structured_outputs_dead_end",
            "Requests ended because their structured-outputs constraint allowed no token at all after "
            "what they had generated (a part of it no text can match; each also counted as an abort).",
            labels,
            registry=reg,
        ).labels(model_name)
        self.responses_not_stored = Counter(
            "ferry:responses_not_stored",
            "Responses asked to be stored that were not (the response store failed or was too small).",
            labels,
            registry=reg,
        ).labels(model_name)
        self.background_running = Gauge(
            "ferry:responses_background_running",
            "Background responses (background: true) queued or running in this replica.",
            labels,
            registry=reg,
            multiprocess_mode="livesum",
        ).labels(model_name)
        self._background_finished = Counter(
            "ferry:responses_background",
            "Background responses finished, by final status.",
            labels + ["status"],
            registry=reg,
        )
        self.background_orphaned = Counter(
            "ferry:responses_background_orphaned",
            "Background responses found running with no process left to run them, saved as failed.",
            labels,
            registry=reg,
        ).labels(model_name)
        self._params_n = Histogram(
            "vllm:request_params_n",
            "Histogram of the n request parameter.",
            vllm_labels,
            buckets=(1, 2, 5, 10, 20),
            registry=reg,
        ).labels(*ours)
        self._params_max_tokens = Histogram(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            vllm_labels,
            buckets=_TOKEN_BUCKETS,
            registry=reg,
        ).labels(*ours)
        if engine_stats is not None:
            reg.register(EngineStatsCollector(engine_stats, model_name, max_loras, cache_info))
        # One of several API server processes (``--api-server-count``): every process's metrics
        # (these, the other API servers', the engine process's KV tier ones) are in the directory
        # prometheus-client's multiprocess mode writes to; the engine's from its latest stats.
        self._replica: CollectorRegistry | None = None
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            self._replica = CollectorRegistry()
            MultiProcessCollector(self._replica)
            if engine_stats is not None:
                self._replica.register(EngineStatsCollector(engine_stats, model_name, max_loras, cache_info))

    def observe_params(self, n: int, max_tokens: int | None) -> None:
        """An admitted generation request's ``n`` and ``max_tokens`` (the budget it runs with)."""
        self._params_n.observe(n)
        if max_tokens is not None:
            self._params_max_tokens.observe(max_tokens)

    def observe_prompt_finished(self, most_generated: int) -> None:
        """All the choices of one prompt of a request ended: the most tokens one of them generated
        (vLLM observes its ``request_max_num_generation_tokens`` once per parent request)."""
        self._max_generation_tokens.observe(most_generated)

    def background_finished(self, status: str) -> None:
        self._background_finished.labels(self.model_name, status).inc()

    def observe_first_token(self, ttft_s: float, num_tokens: int = 1) -> None:
        """A request's first delta, of ``num_tokens``: the first is its TTFT; the others came with
        it (a gap of 0 each), so a request's inter-token samples are always its tokens - 1."""
        self._ttft.observe(ttft_s)
        for _ in range(num_tokens - 1):
            self._itl.observe(0.0)
            self._tpot.observe(0.0)

    def observe_tokens(self, interval_s: float, new_tokens: int) -> None:
        # A delta can carry several tokens when the server fell behind the engine: spread the
        # interval over them rather than reporting one long gap and no short ones.
        per_token = interval_s / new_tokens
        for _ in range(new_tokens):
            self._itl.observe(per_token)
            self._tpot.observe(per_token)

    def observe_finished(
        self,
        reason: str,
        e2e_s: float,
        engine_metrics: Mapping[str, float] | None,
        prompt_tokens: int | None = None,
        generation_tokens: int = 0,
    ) -> Phases:
        """A request's end. ``prompt_tokens`` is None for one that never reached the engine; the
        phase times come from the engine's stamps (``time.monotonic()``: arrival, first scheduled,
        first token, finished), observed only for the phases the request went through (none for a
        request aborted before its last output: it has no stamps). Returns those phase times (its
        trace span says the same: ``server/tracing.py``)."""
        counter = self._success_by_reason.get(reason)
        if counter is None:
            counter = self._success.labels(self.model_name, ENGINE_INDEX, reason)
            self._success_by_reason[reason] = counter
        counter.inc()
        self._e2e.observe(e2e_s)
        if prompt_tokens is not None:
            self._prompt_tokens.observe(prompt_tokens)
            self._generation_tokens.observe(generation_tokens)
        phases = phases_of(engine_metrics)
        if phases.queue is not None:
            self._queue.observe(phases.queue)
        if phases.prefill is not None:
            self._prefill.observe(phases.prefill)
        if phases.decode is not None:
            self._decode.observe(phases.decode)
            if generation_tokens > 1:
                self._request_tpot.observe(phases.decode / (generation_tokens - 1))
        if phases.inference is not None:
            self._inference.observe(phases.inference)
        return phases

    def render(self) -> bytes:
        """The text exposition of this server's metrics plus the default registry (KV tier, process),
        or, under ``--api-server-count``, the whole replica's."""
        return self.exposition(None)[0]

    def exposition(self, accept: str | None) -> tuple[bytes, str]:
        """What ``render`` shows, in the format a scrape's ``Accept`` header asks for (the text
        format, or OpenMetrics), and its content type."""
        source = self._replica if self._replica is not None else Collectors((self.registry, REGISTRY))
        return exposition(source, accept)
