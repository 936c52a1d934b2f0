"""``EngineStatsCollector``: the engine's state under vLLM's names, read from ``engine.stats()`` once
per scrape and never pushed per token: running and waiting requests, KV usage, prefix-cache
queries and hits, preemptions, prompt and generation tokens, tokens per engine step, speculative
decoding's drafts and acceptances, the sleep state, the cache's configuration and the LoRA
adapters in use.

``ServerMetrics`` (``server/metrics.py``) registers it in its registry (and, under
``--api-server-count``, in the replica's); split from there so that the per-request metrics the
serving layer observes read apart from the engine's, which it only reads.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.stats import ITERATION_TOKEN_BUCKETS

# vLLM labels its series with the engine's index beside the model (``vllm:lora_requests_info``
# aside); a replica runs one engine, index "0".
ENGINE_INDEX = "0"
_VLLM_LABELS = ["model_name", "engine"]

# (exposed name without _total, help, EngineStats attribute, kind)
_ENGINE_SERIES: tuple[tuple[str, str, str, str], ...] = (
    ("vllm:num_requests_running", "Number of requests in model execution batches.", "num_running", "gauge"),
    ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", "num_waiting", "gauge"),
    ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "kv_cache_usage", "gauge"),
    # vLLM's deprecated name of the same gauge, which its stock Grafana dashboard still plots
    (
        "vllm:gpu_cache_usage_perc",
        "GPU KV-cache usage. 1 means 100 percent usage (deprecated: vllm:kv_cache_usage_perc).",
        "kv_cache_usage",
        "gauge",
    ),
    (
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        "prefix_cache_queries",
        "counter",
    ),
    (
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        "prefix_cache_hits",
        "counter",
    ),
    (
        "ferry:partial_prefix_cache_hits",
        "Prefix cache hits copied from cached partial blocks (included in vllm:prefix_cache_hits).",
        "partial_prefix_hits",
        "counter",
    ),
    (
        "vllm:num_preemptions",
        "Cumulative number of preemptions from the engine.",
        "num_preemptions",
        "counter",
    ),
    (
        "ferry:prefix_waits",
        "Admissions put off so a request reuses a prompt block another request is computing.",
        "num_prefix_waits",
        "counter",
    ),
    ("vllm:prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens", "counter"),
    ("vllm:generation_tokens", "Number of generation tokens processed.", "generation_tokens", "counter"),
)


_SPEC_SERIES = (
    ("vllm:spec_decode_num_drafts", "Request-steps that verified draft tokens.", "spec_decode_num_drafts"),
    ("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.", "spec_decode_num_draft_tokens"),
    ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", "spec_decode_num_accepted_tokens"),
)


class EngineStatsCollector(Collector):
    """Reads ``engine.stats()`` once per scrape and exposes it under vLLM's names; and the cache's
    configuration (``vllm:cache_config_info``: its values as labels, 1 as the value)."""

    def __init__(
        self,
        stats: Callable[[], Any],
        model_name: str,
        max_loras: int | None = None,
        cache_info: Mapping[str, str] | None = None,
    ) -> None:
        self._stats = stats
        self._model_name = model_name
        self._vllm_values = [model_name, ENGINE_INDEX]
        self._max_loras = max_loras
        self._cache_info = dict(cache_info or {})

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        for name, doc, attr, kind in _ENGINE_SERIES:
            value = getattr(stats, attr, None)
            if value is None:
                continue
            family_cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            vllm = name.startswith("vllm:")  # vLLM's carry the engine index; ferry's own, the model only
            family = family_cls(name, doc, labels=_VLLM_LABELS if vllm else ["model_name"])
            family.add_metric(self._vllm_values if vllm else [self._model_name], float(value))
            yield family
        counts = getattr(stats, "iteration_tokens_counts", ())
        if counts:
            family = HistogramMetricFamily(
                "vllm:iteration_tokens_total",
                "Histogram of number of tokens per engine_step.",
                labels=_VLLM_LABELS,
            )
            edges = [str(float(e)) for e in ITERATION_TOKEN_BUCKETS] + ["+Inf"]
            family.add_metric(
                self._vllm_values,
                list(zip(edges, itertools.accumulate(counts), strict=True)),
                float(stats.iteration_tokens_sum),
            )
            yield family
        if self._cache_info:
            info = GaugeMetricFamily(
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig.",
                labels=[*self._cache_info, "engine"],
            )
            info.add_metric([*self._cache_info.values(), ENGINE_INDEX], 1.0)
            yield info
        per_position = getattr(stats, "spec_decode_accepted_per_position", ())
        if per_position:  # speculative decoding is on: vLLM's names
            for name, doc, attr in _SPEC_SERIES:
                family = CounterMetricFamily(name, doc, labels=_VLLM_LABELS)
                family.add_metric(self._vllm_values, float(getattr(stats, attr)))
                yield family
            family = CounterMetricFamily(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Accepted draft tokens, by their position in the draft.",
                labels=[*_VLLM_LABELS, "position"],
            )
            for pos, count in enumerate(per_position):
                family.add_metric([*self._vllm_values, str(pos)], float(count))
            yield family
        # vLLM's sleep gauge: one series per state, 1 for the engine's (engine 0: one engine here).
        level = getattr(stats, "sleep_level", 0)
        sleep = GaugeMetricFamily(
            "vllm:engine_sleep_state",
            "The engine's sleep state, one series per state: awake (1 while it serves), "
            "weights_offloaded (1 asleep at level 1), discard_all (1 asleep at level 2).",
            labels=["model_name", "engine", "sleep_state"],
        )
        for state, at in (("awake", 0), ("weights_offloaded", 1), ("discard_all", 2)):
            sleep.add_metric([self._model_name, ENGINE_INDEX, state], float(level == at))
        yield sleep
        if self._max_loras is not None:
            # vLLM's: the adapters in use as labels, the time of the reading as the value.
            info = GaugeMetricFamily(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            )
            running = ",".join(getattr(stats, "running_loras", ()))
            waiting = ",".join(getattr(stats, "waiting_loras", ()))
            info.add_metric([str(self._max_loras), running, waiting], time.time())
            yield info
