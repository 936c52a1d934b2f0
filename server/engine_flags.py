"""The engine's `ferry serve` flags, 1:1 with ``EngineConfig`` fields (``--num-kv-blocks`` ->
``num_kv_blocks``), their defaults read from ``EngineConfig()`` (``add_engine_flags``).

``server.args.engine_options`` picks them back by field name, so a new ``EngineConfig`` field
only needs a flag here. Imported by ``ferry --help``: it must stay torch-free.
"""

from __future__ import annotations

import argparse

from engine.config import EngineConfig
from engine.sampling_params import LOGPROBS_MODES
from server.server_flags import human_int


def _bool_flag(p: argparse.ArgumentParser, name: str, default: bool, help: str) -> None:
    p.add_argument(name, action=argparse.BooleanOptionalAction, default=default, help=help)


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The engine's flags, each defaulting to its ``EngineConfig`` field."""
    d = EngineConfig()
    p.add_argument("--kv-tier", default=d.kv_tier, help="memory://… | redis://host:port/db | rediss://…")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=human_int, default=d.max_num_batched_tokens)
    p.add_argument(
        "--burst-wait-ms",
        type=float,
        default=d.burst_wait_ms,
        help="most an idle engine holds its first step to let the rest of a burst of requests in "
        "(it stops as soon as every request received is taken in); 0: start on the first",
    )
    p.add_argument(
        "--step-timeout-s",
        type=float,
        default=d.step_timeout_s,
        help="seconds one engine step may run before the engine counts as stuck: /health answers "
        "503 (so an orchestrator restarts the replica) until it ends; 0: never",
    )
    p.add_argument(
        "--structured-outputs-mask-budget-ms",
        type=float,
        default=d.structured_outputs_mask_budget_ms,
        help="most CPU time of the engine thread a request's structured-outputs grammar may cost a "
        "token (mean of its last 8, the costliest left out); past it the request ends with a 400 "
        "naming the cost, as every request in the batch waits for its mask; 0: no limit",
    )
    p.add_argument(
        "--scheduling-policy",
        default=d.scheduling_policy,
        choices=["fcfs", "priority"],
        help="fcfs: arrival order; priority: requests' priority field, lower first (a request may "
        "preempt running ones of a lower priority), then arrival",
    )
    p.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=d.long_prefill_token_threshold,
        help="most prompt tokens one request computes per step (bounds the decode gap a long prompt "
        "causes; 0: only --max-num-batched-tokens)",
    )
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument(
        "--kv-cache-dtype",
        default=d.kv_cache_dtype,
        choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
        help="KV cache element type: auto (the model's) or fp8 (2x the tokens of a bf16 cache in the "
        "same memory; values divided by the checkpoint's per-layer k_scale / v_scale when it has them, "
        "else stored unscaled, as vLLM's)",
    )
    p.add_argument("--num-kv-blocks", type=int, default=d.num_kv_blocks)
    p.add_argument(
        "--kv-cache-memory-bytes",
        type=human_int,
        default=d.kv_cache_memory_bytes,
        help="KV cache size when --num-kv-blocks is not given (default: on CUDA, what "
        "--gpu-memory-utilization leaves; on CPU, 512 MiB)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=d.gpu_memory_utilization,
        help="share of the GPU's memory the engine may use (weights, activations, KV cache), as vLLM's; "
        "sizes the KV cache when neither --num-kv-blocks nor --kv-cache-memory-bytes is given",
    )
    p.add_argument(
        "--max-model-len",
        type=human_int,
        default=d.max_model_len,
        help="context length, at most the model's max_position_embeddings (times a linear rope "
        "scaling factor), which is the default",
    )
    p.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"])
    p.add_argument("--attention-backend", default=d.attention_backend, choices=["auto", "torch", "triton"])
    p.add_argument("--num-threads", type=int, default=d.num_threads, help="torch intra-op threads on CPU")
    p.add_argument("--seed", type=int, default=d.seed, help="default seed of requests that give none")
    p.add_argument("--max-logprobs", type=int, default=d.max_logprobs)
    p.add_argument(
        "--logprobs-mode",
        default=d.logprobs_mode,
        choices=list(LOGPROBS_MODES),
        help="what reported logprobs are, as vLLM's: raw_logprobs (the model's distribution, the "
        "default), processed_logprobs (the one a token was drawn from: after penalties, temperature "
        "and top-k/top-p/min-p), raw_logits or processed_logits (logits instead); prompt logprobs "
        "are always raw",
    )
    p.add_argument(
        "--pooling-type",
        default=d.pooling_type,
        choices=["auto", "last", "mean", "cls"],
        help="how /v1/embeddings pools a prompt's hidden states (auto: the model's sentence-transformers "
        "Pooling config, else the last token)",
    )
    p.add_argument(
        "--enable-sleep-mode",
        action="store_true",
        default=d.enable_sleep_mode,
        help="allow POST /sleep and /wake_up (vLLM's): free the KV cache and offload or drop the weights "
        "while a colocated trainer uses the memory",
    )
    p.add_argument(
        "--enable-lora",
        action="store_true",
        default=d.enable_lora,
        help="serve LoRA adapters (--lora-modules, or loaded at run time) beside the base model",
    )
    p.add_argument(
        "--enable-prompt-embeds",
        action="store_true",
        default=d.enable_prompt_embeds,
        help="/v1/completions takes prompt_embeds: base64 torch.save'd tensors [seq_len, hidden] used as the "
        "prompt's input embeddings (read with torch.load(weights_only=True))",
    )
    p.add_argument(
        "--max-loras", type=int, default=d.max_loras, help="distinct LoRA adapters one engine step may run"
    )
    p.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank, help="largest LoRA rank accepted")
    p.add_argument(
        "--max-cpu-loras",
        type=int,
        default=d.max_cpu_loras,
        help="LoRA adapters kept loaded (least recently used read again when named; default --max-loras)",
    )
    p.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='speculative decoding, as vLLM\'s: \'{"method": "ngram", "num_speculative_tokens": 3, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' drafts tokens from earlier context, '
        '\'{"model": "DRAFT_DIR", "num_speculative_tokens": 3}\' with a smaller model of the same '
        'vocabulary, \'{"method": "deepseek_mtp", "num_speculative_tokens": 1}\' with a DeepSeek-V3 '
        "checkpoint's multi-token-prediction layer; drafts are verified in the next step (outputs are "
        "unchanged)",
    )
    p.add_argument(
        "--generation-config",
        default=d.generation_config,
        metavar="auto|vllm|DIR",
        help="default sampling values of requests that leave them unset (temperature, top_p, top_k, "
        "min_p, repetition_penalty; max_new_tokens caps max_tokens), as vLLM's: auto = the model's "
        "generation_config.json, vllm = neutral defaults, DIR = a directory holding one",
    )
    p.add_argument(
        "--override-generation-config",
        default=None,
        metavar="JSON",
        help="default sampling values over those of --generation-config, e.g. '{\"temperature\": 0.5}'",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|TEMPLATE",
        help="a Jinja chat template (a file, or the template inline) used instead of the model's own",
    )
    p.add_argument(
        "--chat-template-content-format",
        default=d.chat_template_content_format,
        choices=["auto", "string", "openai"],
        help="message content as the template takes it: one string, or a list of text parts "
        "(openai); auto: what the template reads",
    )
    p.add_argument("--kv-tier-write-queue", type=int, default=d.kv_tier_write_queue)
    p.add_argument(
        "--deterministic",
        action="store_true",
        default=d.deterministic,
        help="batch-invariant numerics: a request's tokens do not depend on its batch",
    )
    _bool_flag(
        p, "--enable-prefix-caching", d.enable_prefix_caching, "reuse KV blocks of shared prompt prefixes"
    )
    _bool_flag(
        p,
        "--partial-prefix-caching",
        d.partial_prefix_caching,
        "with prefix caching, also reuse a finished request's last, partly filled block (copied)",
    )
    _bool_flag(p, "--kv-events", d.kv_events, "publish KV block stored/removed events to the tier")
    p.add_argument(
        "--kv-events-replica-id",
        default=d.kv_events_replica_id,
        help="replica id on published KV events; routers match it to replica URLs (default: the advertised URL)",
    )
