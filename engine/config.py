"""Engine configuration: one frozen dataclass, built once (from the CLI or LLM(**options))."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from engine.chat_template import CONTENT_FORMATS, resolve_chat_template
from engine.generation_defaults import parse_overrides
from engine.sampling_params import LOGPROBS_MODES
from engine.spec_decode import SpeculativeConfig

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
# vLLM's --tokenizer-mode values ferry serves: both read the fast tokenizer (tokenizer.json).
TOKENIZER_MODES = ("auto", "hf")
# vLLM's --load-format values ferry serves (dummy: random weights, nothing read from the checkpoint).
LOAD_FORMATS = ("auto", "safetensors", "dummy")
# vLLM's --quantization names a checkpoint may be served under -> the quant_method it must declare
# (vLLM's Marlin kernels are its names for GPTQ and AWQ checkpoints run with those kernels).
QUANTIZATION_METHODS = {
    "gptq": "gptq",
    "gptq_marlin": "gptq",
    "awq": "awq",
    "awq_marlin": "awq",
    "compressed-tensors": "compressed-tensors",
    "fp8": "fp8",
    "mxfp4": "mxfp4",
}


@dataclass(frozen=True)
class EngineConfig:
    """Every engine option. Field names are the CLI flags in snake_case (``--num-kv-blocks`` ->
    ``num_kv_blocks``), so a flag and its Python spelling never drift apart."""

    model: str | None = None  # HF directory (or hub id); None = the built-in demo model
    # vLLM's --tokenizer: the directory (or hub id) of the tokenizer, chat template and special
    # tokens when they are not the model's own; None: the model directory.
    tokenizer: str | None = None
    tokenizer_mode: str = "auto"  # auto | hf (vLLM's slow and mistral tokenizers are not served)
    # vLLM's --revision / --tokenizer-revision / --download-dir: what a hub id resolves to and
    # where it is downloaded (engine/models/loader.py resolve_model_dir); a local directory is read
    # as it is. tokenizer_revision None: revision.
    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    # vLLM's --hf-overrides: a JSON object (or its text) merged over config.json before it is read
    # (engine/models/config.py read_hf_config); held parsed, as a dict. None: none.
    hf_overrides: Any = None
    # vLLM's --quantization: the method the checkpoint must be quantized with (checked, never
    # applied: ferry does no online quantization). None: whatever the checkpoint says.
    quantization: str | None = None
    load_format: str = "auto"  # auto | safetensors | dummy (random weights, for benchmarks)
    dtype: str = (
        "auto"  # auto | float32 | bfloat16 | float16 (auto: the checkpoint's, float32 on CPU for fp16)
    )
    device: str = "auto"  # auto | cpu | cuda
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: derived from kv_cache_memory_bytes
    # None: on CUDA, what gpu_memory_utilization leaves after the weights and an activation
    # reserve (engine/kv_budget.py); on CPU, 512 MiB.
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9  # vLLM's: the share of the GPU's memory this engine may use
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # Most milliseconds an idle AsyncEngine holds its first step to let the rest of a burst of
    # arrivals in (engine/async_burst.py ``_gather_burst``); 0: start on the first arrival.
    burst_wait_ms: float = 25.0
    # A step (or command) of the engine loop that runs this many seconds means the loop is stuck
    # (a hung kernel or collective, a deadlock): the engine reports unhealthy (/health 503) until
    # it ends, and logs where the loop is (vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S); 0: never.
    step_timeout_s: float = 60.0
    # Most CPU time of the engine thread a request's structured-outputs grammar may cost a token
    # (its mask fill and advance), as a mean over its last 8 tokens with the costliest left out
    # (engine/grammar_matcher.py): past it the request is ended with an error (a 400), since
    # every request in the batch waits for its mask. Cheap grammars cost 0.001-0.1 ms (1-3 ms at a
    # 150k vocabulary); known costly ones 7-40 ms at 20k, growing with the vocabulary. 0: no limit.
    structured_outputs_mask_budget_ms: float = 50.0
    # vLLM's: fcfs (arrival order) | priority (requests' priority, lower first; engine/scheduler.py)
    scheduling_policy: str = "fcfs"
    # vLLM's name: a prefill computes at most this many tokens per step (0: no cap beyond the
    # budget), so one long prompt cannot stretch a step, and every running decode's token gap.
    long_prefill_token_threshold: int = 0
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    # With prefix caching: a request's last, partly filled block outlives it, and a later request
    # extending its tokens copies that block's KV instead of recomputing it (engine/scheduler_sharing.py).
    partial_prefix_caching: bool = True
    # vLLM's --kv-cache-dtype: auto (the model's dtype) | fp8 / fp8_e4m3 | fp8_e5m2. An fp8 cache
    # holds 2x (bf16) or 4x (fp32) the tokens in the same memory; values are stored divided by the
    # checkpoint's per-layer K/V scales (engine/models/kv_scales.py; 1.0 when it has none, as vLLM)
    # and widened back, times the scale, when attention reads them.
    kv_cache_dtype: str = "auto"
    deterministic: bool = False
    attention_backend: str = "auto"  # auto | torch | triton
    kv_tier: str | None = None  # memory://… | redis://… | rediss://… ; None: no tier
    kv_tier_write_queue: int = 256  # bounded queue of pending tier writes (full: drop + count)
    kv_events: bool = False  # publish block stored/removed events to the tier (Redis stream)
    # The replica id on published KV events; routers match it against replica URLs, so `ferry
    # serve` sets its advertised URL. None: "host:pid".
    kv_events_replica_id: str | None = None
    seed: int = 0  # engine-level default seed for requests that give none
    num_threads: int | None = None  # torch intra-op threads on CPU
    max_logprobs: int = 20
    # What reported logprobs are (vLLM's --logprobs-mode, LOGPROBS_MODES): the model's distribution
    # (raw) or the one a token was drawn from (processed), as log-probabilities or logits.
    logprobs_mode: str = "raw_logprobs"
    # How an embedding pools its prompt's hidden states: auto | last | mean | cls (engine/pooler.py)
    pooling_type: str = "auto"
    # LoRA adapters (engine/lora.py): vLLM's flags. max_loras: adapters one step may run (each
    # kept on the device); max_cpu_loras: adapters kept loaded (None: max_loras).
    enable_lora: bool = False
    # vLLM's --enable-prompt-embeds: prompts may be given as input embeddings [seq_len, hidden]
    # instead of tokens (engine/prompt_embeds.py).
    enable_prompt_embeds: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # vLLM's: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n, ...},
    # {"model": "/draft", "num_speculative_tokens": k} or {"method": "deepseek_mtp" (or "mtp"),
    # "num_speculative_tokens": k} (a dict or its JSON text), held parsed
    # (engine/spec_decode.py SpeculativeConfig). None: no drafts.
    speculative_config: Any = None
    # The model creator's default sampling values (engine/generation_defaults.py), as vLLM's flags:
    # auto (the model's generation_config.json) | vllm (neutral defaults) | a directory holding one;
    # the overrides (a dict or its JSON text) apply on top.
    generation_config: str = "auto"
    override_generation_config: Any = None
    # vLLM's --chat-template: a file or an inline template replacing the model's own, held as the
    # template's text (engine/chat_template.py resolve_chat_template); and how message content
    # reaches it: auto | string | openai.
    chat_template: str | None = None
    chat_template_content_format: str = "auto"
    # vLLM's --enable-sleep-mode: sleep(level) frees the KV cache and offloads (1) or drops (2) the
    # weights, wake_up(tags) restores them (engine/sleep_mode.py). Weight updates need no flag.
    enable_sleep_mode: bool = False

    def __post_init__(self) -> None:
        # Numbers out of range fail here, by name, instead of as a division by zero or a silent
        # default deep in the runner.
        at_least = {
            "block_size": 1,
            "max_num_seqs": 1,
            "max_num_batched_tokens": 1,
            "long_prefill_token_threshold": 0,
            "kv_tier_write_queue": 1,
            "max_logprobs": 0,
            "max_loras": 1,
            "max_lora_rank": 1,
        }
        optional_at_least = {
            "num_kv_blocks": 1,
            "max_model_len": 1,
            "num_threads": 1,
            "kv_cache_memory_bytes": 1,
            "max_cpu_loras": 1,
        }
        for name, low in [*at_least.items(), *optional_at_least.items()]:
            value = getattr(self, name)
            if value is None and name in optional_at_least:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        wait = self.burst_wait_ms
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= 10_000:
            raise ValueError(f"burst_wait_ms must be a number of milliseconds in [0, 10000], got {wait!r}")
        budget = self.structured_outputs_mask_budget_ms
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 <= budget < 1e9:
            raise ValueError(
                f"structured_outputs_mask_budget_ms must be a number of milliseconds >= 0, got {budget!r}"
            )
        timeout = self.step_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout < 1e9:
            raise ValueError(f"step_timeout_s must be a number of seconds >= 0, got {timeout!r}")
        util = self.gpu_memory_utilization
        if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util!r}")
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        object.__setattr__(
            self, "override_generation_config", parse_overrides(self.override_generation_config) or None
        )
        if self.chat_template is not None:
            object.__setattr__(self, "chat_template", resolve_chat_template(self.chat_template))
        if self.chat_template_content_format not in CONTENT_FORMATS:
            raise ValueError(
                f"chat_template_content_format must be one of {', '.join(CONTENT_FORMATS)}, "
                f"got {self.chat_template_content_format!r}"
            )
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(
                f"generation_config must be 'auto', 'vllm' or a directory, got {self.generation_config!r}"
            )
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})"
            )
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
        object.__setattr__(self, "hf_overrides", _json_object("hf_overrides", self.hf_overrides))
        if self.tokenizer_mode not in TOKENIZER_MODES:
            raise ValueError(
                f"tokenizer_mode {self.tokenizer_mode!r} is not supported: ferry reads the fast tokenizer "
                f"(tokenizer.json) only; use {' or '.join(TOKENIZER_MODES)}"
            )
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"load_format {self.load_format!r} is not supported: ferry reads safetensors weights "
                f"(choose {', '.join(LOAD_FORMATS)})"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(
                f"quantization {self.quantization!r} is not supported: ferry serves checkpoints quantized "
                f"with {', '.join(QUANTIZATION_METHODS)} (dequantized at load)"
            )
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}")
        if self.pooling_type not in ("auto", "last", "mean", "cls"):
            raise ValueError(f"pooling_type must be auto, last, mean or cls, got {self.pooling_type!r}")

    @classmethod
    def from_options(cls, **options: object) -> EngineConfig:
        """Build from keyword options, rejecting unknown names with a clear message."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(
                f"unknown engine option(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return cls(**options)  # type: ignore[arg-type]


def _json_object(name: str, value: Any) -> dict[str, Any] | None:
    """A dict, or the JSON text of an object; None and ``{}`` are None."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"{name} is not valid JSON ({e}): {value!r}") from None
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}: {value!r}")
    return value or None
