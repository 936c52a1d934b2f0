"""vLLM's ``LLM(...)`` constructor options that are no ``EngineConfig`` field: a vLLM script's
``LLM(model, tensor_parallel_size=1, enforce_eager=True, trust_remote_code=True, ...)`` builds
ferry's LLM unchanged. Options for what ferry does anyway or has no use for are accepted and
logged once each with what ferry does instead (as ``server/vllm_compat.py`` notes ``vllm serve``'s
flags); the parallel sizes are taken at 1 only and ``cpu_offload_gb`` at 0 only (a ValueError
naming the option otherwise: ferry cannot have them). Torch-free input checking only.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger("engine.llm")

_SCALE_OUT = "a ferry engine runs on one device; scale out with replicas behind `ferry router`"
# engine/image_processor.py's cache (PROCESSED_CACHE_SIZE; not imported: this module is torch-free).
_IMAGE_CACHE = "the last 32 images read from bytes are kept processed"
_POOLING = (
    "ferry reads the task from the checkpoint: every model embeds (LLM.embed, LLM.encode), "
    "*ForSequenceClassification models classify and score"
)

# Accepted for compatibility: option -> what ferry does instead.
COMPAT_OPTIONS: dict[str, str] = {
    "enforce_eager": "ferry captures no CUDA graphs; every step runs eagerly",
    "trust_remote_code": "no code from a checkpoint is ever run; architectures are ferry's own",
    "swap_space": "preempted requests are recomputed from the prefix cache, not swapped",
    "disable_log_stats": "the offline engine logs no stats",
    "max_seq_len_to_capture": "ferry captures no CUDA graphs",
    "disable_custom_all_reduce": "one device: there is no all-reduce",
    "disable_async_output_proc": "outputs are made in the engine's own loop",
    "compilation_config": "ferry does not torch.compile the model",
    "enable_chunked_prefill": "prefills are always chunked to max_num_batched_tokens",
    "async_scheduling": "the engine steps in the caller's thread",
    "enable_expert_parallel": "one device: experts are not split",
    "max_parallel_loading_workers": "weights are read from safetensors files in one pass",
    "mm_processor_cache_gb": _IMAGE_CACHE,
    "disable_mm_preprocessor_cache": _IMAGE_CACHE,
    "task": _POOLING,
    "runner": _POOLING,
    "convert": _POOLING,
}

# Taken at one value only: option -> (the value ferry honours, why no other can be had).
LIMITED_OPTIONS: dict[str, tuple[Any, str]] = {
    "tensor_parallel_size": (1, _SCALE_OUT),
    "pipeline_parallel_size": (1, _SCALE_OUT),
    "data_parallel_size": (1, _SCALE_OUT),
    "cpu_offload_gb": (0, "ferry keeps every weight on the device; use a smaller or quantized checkpoint"),
}


def take_vllm_options(options: dict[str, object]) -> None:
    """Remove vLLM's options ``COMPAT_OPTIONS`` and ``LIMITED_OPTIONS`` name from ``options`` (what
    is left are ``EngineConfig`` fields, or unknown names ``EngineConfig.from_options`` refuses),
    logging each; ValueError for a limited one at another value."""
    for name, (honoured, refusal) in LIMITED_OPTIONS.items():
        if name in options:
            value = options.pop(name)
            if value != honoured:
                raise ValueError(f"{name}={value!r}: {refusal} ({name}={honoured!r} only)")
    given: Mapping[str, object] = {n: options.pop(n) for n in list(options) if n in COMPAT_OPTIONS}
    for name in given:
        logger.info(
            "LLM option %s is accepted for vLLM compatibility and changes nothing: %s",
            name,
            COMPAT_OPTIONS[name],
        )
