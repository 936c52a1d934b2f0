"""vLLM v1 labels its series with the engine's index beside the model (``engine="0"`` for one
engine; ``vllm:cache_config_info`` too, ``vllm:lora_requests_info`` not), so per-engine dashboards
and ``by (engine)`` queries work: every ``vllm:`` series of a replica carries it, ferry's own
(``ferry:``) do not. Read from a ``ServerMetrics`` fed a real ``EngineStats`` with every optional
part on (speculative decoding, LoRA, the cache's configuration, step histogram)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from engine.stats import ITERATION_TOKEN_BUCKETS, EngineStats
from server.metrics import ServerMetrics

# Every vllm: family a replica exposes with all its parts on (exposed names, _total stripped).
VLLM_FAMILIES = {
    "vllm:cache_config_info",
    "vllm:e2e_request_latency_seconds",
    "vllm:engine_sleep_state",
    "vllm:generation_tokens",
    "vllm:gpu_cache_usage_perc",
    "vllm:inter_token_latency_seconds",
    "vllm:iteration_tokens_total",
    "vllm:kv_cache_usage_perc",
    "vllm:lora_requests_info",
    "vllm:num_preemptions",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:prefix_cache_hits",
    "vllm:prefix_cache_queries",
    "vllm:prompt_tokens",
    "vllm:request_decode_time_seconds",
    "vllm:request_generation_tokens",
    "vllm:request_inference_time_seconds",
    "vllm:request_max_num_generation_tokens",
    "vllm:request_params_max_tokens",
    "vllm:request_params_n",
    "vllm:request_prefill_time_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_queue_time_seconds",
    "vllm:request_success",
    "vllm:request_time_per_output_token_seconds",
    "vllm:spec_decode_num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_drafts",
    "vllm:time_per_output_token_seconds",
    "vllm:time_to_first_token_seconds",
}


def test_vllm_series_carry_the_engine_index_and_ferrys_do_not() -> None:
    stats = EngineStats(
        num_running=1,
        spec_decode_num_drafts=2,
        spec_decode_num_draft_tokens=4,
        spec_decode_num_accepted_tokens=3,
        spec_decode_accepted_per_position=(2, 1),
        iteration_tokens_counts=(1,) + (0,) * len(ITERATION_TOKEN_BUCKETS),
        iteration_tokens_sum=1,
    )
    metrics = ServerMetrics("m", lambda: stats, max_loras=2, cache_info={"block_size": "16"})
    metrics.observe_params(1, 4)
    metrics.observe_first_token(0.01, 2)
    metrics.observe_finished("stop", 0.1, None, 3, 2)
    metrics.observe_prompt_finished(2)
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    # (the text parser takes a counter's or histogram's _created samples for a family of their own)
    exposed = {name.removesuffix("_created") for name in families if name.startswith("vllm:")}
    assert exposed == VLLM_FAMILIES
    for name, family in families.items():
        engines = {s.labels.get("engine") for s in family.samples}
        if name == "vllm:lora_requests_info":  # vLLM's has no engine label
            assert engines == {None}, name
        elif name.startswith("vllm:"):
            assert engines == {"0"}, name
            if name != "vllm:cache_config_info":
                assert {s.labels["model_name"] for s in family.samples} == {"m"}, name
        elif name.startswith("ferry:") and any("model_name" in s.labels for s in family.samples):
            assert engines == {None}, name  # the serving layer's own: the model only
    running = families["vllm:num_requests_running"].samples
    assert [(s.labels, s.value) for s in running] == [({"engine": "0", "model_name": "m"}, 1.0)]
    info = families["vllm:cache_config_info"].samples
    assert [(s.labels, s.value) for s in info] == [({"block_size": "16", "engine": "0"}, 1.0)]
    ended = [s for s in families["vllm:request_success"].samples if s.name.endswith("_total")]
    assert {s.labels["finished_reason"]: s.value for s in ended} == {"stop": 1.0, "length": 0.0, "abort": 0.0}
