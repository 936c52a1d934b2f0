"""`ferry serve` flags (DESIGN.md names).

Engine flags map 1:1 onto ``EngineConfig`` fields (``--num-kv-blocks`` -> ``num_kv_blocks``):
``engine_options(args)`` picks them by field name, so a new EngineConfig field only needs a flag
here and can never drift. Everything else is the server's (``server_config(args)``). This module
is imported by ``ferry --help``; it must stay torch-free.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import fields
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig
from engine.sampling_params import LOGPROBS_MODES
from server.http_limits import add_header_timeout_arg
from server.vllm_flags import add_vllm_args, http_options

# The names in the registries of server/tool_parsers.py and server/reasoning_parsers.py (kept
# here: this module must stay light).
TOOL_PARSER_NAMES = (
    "deepseek_v3",
    "deepseek_v31",
    "glm45",
    "granite",
    "hermes",
    "kimi_k2",
    "llama3_json",
    "llama4_pythonic",
    "mistral",
    "openai",
    "phi4_mini_json",
    "pythonic",
    "qwen3_coder",
)
REASONING_PARSER_NAMES = ("deepseek_r1", "deepseek_v3", "glm45", "openai_gptoss", "qwen3")

if TYPE_CHECKING:
    from engine.media import MediaOptions
    from server.config import ServerConfig

DEMO_MODEL_NAME = "ferry-demo"
DEFAULT_BATCH_CONCURRENCY = 8  # batch requests at once in `ferry serve`: a modest share of the engine


_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_int(text: str) -> int:
    """An integer flag value with vLLM's human-readable suffixes: ``1k`` = 1,000 and ``25.6k`` =
    25,600 (decimal k/m/g/t, a fraction allowed when the result is whole), ``32K`` = 32,768 (binary
    K/M/G/T, integers only); a plain integer as itself."""
    value = text.strip()
    try:
        if value[-1:] in _BINARY:
            return int(value[:-1]) * _BINARY[value[-1]]
        if value[-1:] in _DECIMAL:
            number = Decimal(value[:-1]) * _DECIMAL[value[-1]]
            if number != number.to_integral_value():
                raise ValueError
            return int(number)
        return int(value)
    except (ValueError, ArithmeticError):
        raise argparse.ArgumentTypeError(
            f"invalid integer {text!r} (a whole number, optionally with k/m/g/t for 10^3.., or K/M/G/T "
            "for 2^10.., e.g. 32K or 1.5k)"
        ) from None


def _bool_flag(p: argparse.ArgumentParser, name: str, default: bool, help: str) -> None:
    p.add_argument(name, action=argparse.BooleanOptionalAction, default=default, help=help)


def add_serve_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    d = EngineConfig()
    # -- server -------------------------------------------------------------------------------
    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="HF model directory, as in `vllm serve MODEL` (the same as --model)",
    )
    p.add_argument("--model", default=None, help="HF model directory (default: the built-in demo model)")
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="read flags from a YAML file of long flag names and values, as `vllm serve --config`; "
        "the command line's flags win (ferry/config_file.py)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--role", choices=["mixed", "prefill", "decode"], default="mixed")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="model id(s) clients send (default: the model directory's name, or ferry-demo); with "
        "several, any is accepted and answers and metrics carry the first (as vLLM's)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize (default: "
        "$FERRY_API_KEY, else vLLM's $VLLM_API_KEY)",
    )
    p.add_argument(
        "--register", default=None, help="redis://… to announce this replica to routers (heartbeat)"
    )
    p.add_argument(
        "--advertise-url",
        default=None,
        help="URL routers use to reach this replica (default: http://HOST:PORT)",
    )
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=256,
        help="sequences waiting to run beyond which new requests get 429 + Retry-After",
    )
    p.add_argument(
        "--max-request-sequences",
        type=int,
        default=16384,
        metavar="N",
        help="most sequences (prompts x n) one completions request may ask for; more is a 400 "
        "(default: %(default)d)",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds after which a request is aborted (408; streams end with an error event)",
    )
    p.add_argument(
        "--max-request-bytes", type=human_int, default=8 * 1024 * 1024, help="larger request bodies get 413"
    )
    add_header_timeout_arg(p)
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds to let in-flight requests finish after SIGTERM before aborting them",
    )
    p.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        help="API server processes in front of one engine process (more than 1: HTTP work of a burst "
        "runs in parallel and off the engine's process; 1: one process, the engine on a thread)",
    )
    p.add_argument(
        "--batch-dir",
        default=None,
        help="where the Files and Batches API keep uploaded files, batch records and results "
        "(default: a temporary directory of this replica, removed when it stops)",
    )
    p.add_argument(
        "--max-batch-concurrency",
        type=int,
        default=None,
        help="requests of batches (/v1/batches) running at once, all batches together (default 8; "
        "`ferry run-batch`: --max-num-seqs)",
    )
    p.add_argument(
        "--max-file-bytes",
        type=human_int,
        default=100 * 1024 * 1024,
        help="larger /v1/files uploads get 413 (default 100 MiB)",
    )
    p.add_argument(
        "--responses-store",
        default="memory",
        help="where /v1/responses keeps responses for previous_response_id and GET: memory (this "
        "replica), redis://host:port/db (shared by the replicas that name it) or none",
    )
    p.add_argument(
        "--responses-store-max-bytes",
        type=human_int,
        default=256 * 1024 * 1024,
        help="memory store: the least recently used responses are dropped beyond this many bytes of JSON",
    )
    p.add_argument(
        "--responses-store-ttl",
        type=float,
        default=30 * 24 * 3600.0,
        help="seconds a stored response is kept after it was written (default 30 days)",
    )
    p.add_argument(
        "--responses-lease-ttl",
        type=float,
        default=5.0,
        help="shared stores: seconds after its process stopped renewing the lease of a background "
        "response (every fifth of this) that a reader reports it failed (at least 1)",
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) served from the start, each as name=path or vLLM's JSON "
        '{"name": …, "path": …, "base_model_name": …}; clients name them as the model (needs --enable-lora)',
    )
    p.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true does the same)",
    )
    p.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let chat and /tokenize requests carry their own chat_template (vLLM's flag; rendered in "
        "the same sandbox as the model's; refused with a 400 without it)",
    )
    p.add_argument(
        "--allowed-local-media-path",
        default=None,
        metavar="DIR",
        help="let chat requests name images as file:// URLs under this directory (vLLM's flag; refused "
        "without it)",
    )
    p.add_argument(
        "--limit-mm-per-prompt",
        default=None,
        metavar="JSON",
        help="most images one prompt may carry, as vLLM's JSON: '{\"image\": 2}' (default: no limit)",
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='serve tool_choice "auto" (the default with tools): needs --tool-call-parser',
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSER_NAMES),
        help="the model's tool-call format, read back into tool_calls: hermes (Hermes, Qwen2.5/3), "
        "llama3_json (Llama 3.x), mistral, openai (gpt-oss), …",
    )
    p.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSER_NAMES),
        help="split a reasoning model's <think>…</think> (gpt-oss: its analysis channel) into "
        "reasoning_content: deepseek_r1, qwen3, openai_gptoss, …",
    )
    # -- engine (1:1 with EngineConfig fields) ------------------------------------------------
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
    add_vllm_args(p)
    return p


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields present on ``args``, by name.

    KV events carry the replica id routers know this server by (its advertised URL) unless
    ``--kv-events-replica-id`` says otherwise.
    """
    values = vars(args)
    opts = {f.name: values[f.name] for f in fields(EngineConfig) if f.name in values}
    if opts.get("kv_events_replica_id") is None:
        opts["kv_events_replica_id"] = server_config(args).url
    return opts


def served_model_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return args.served_model_name[0]
    if args.model:
        path = Path(args.model)
        return path.name if path.is_dir() and path.name else str(args.model)  # a hub id stays whole
    return DEMO_MODEL_NAME


def media_options(args: argparse.Namespace) -> MediaOptions:
    """``--allowed-local-media-path``, ``--limit-mm-per-prompt`` (ValueError if it does not parse) and
    ``--allowed-media-domains``."""
    from engine.media import MediaOptions

    limit = None
    if args.limit_mm_per_prompt is not None:
        try:
            limits = json.loads(args.limit_mm_per_prompt)
        except ValueError:
            raise ValueError(
                f"--limit-mm-per-prompt must be JSON such as '{{\"image\": 2}}', got {args.limit_mm_per_prompt!r}"
            ) from None
        if not isinstance(limits, dict) or any(
            not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in limits.values()
        ):
            raise ValueError("--limit-mm-per-prompt maps each modality to a count: '{\"image\": 2}'")
        limit = limits.get("image")
    path = args.allowed_local_media_path
    if path is not None and not Path(path).is_dir():
        raise ValueError(f"--allowed-local-media-path {path!r} is not a directory")
    domains = args.allowed_media_domains
    return MediaOptions(
        allowed_local_media_path=path,
        limit_images=limit,
        allowed_media_domains=tuple(d.lower() for d in domains) if domains is not None else None,
    )


def server_config(args: argparse.Namespace) -> ServerConfig:
    """Raises ValueError for flags that contradict each other or do not parse."""
    from server.chat_defaults import chat_defaults
    from server.config import ServerConfig, api_key_from
    from server.lora import parse_lora_modules

    lora_modules = parse_lora_modules(args.lora_modules)
    if lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    name = served_model_name(args)
    aliases = tuple(dict.fromkeys(args.served_model_name[1:])) if args.served_model_name else ()
    for module in lora_modules:
        # A request naming the base model runs without an adapter: one of that name is never reached.
        if module.lora_name == name or module.lora_name in aliases:
            raise ValueError(f"--lora-modules names {module.lora_name!r}, the base model's name")
    return ServerConfig(
        served_model_name=name,
        model_aliases=aliases,
        host=args.host,
        port=args.port,
        role=args.role,
        api_key=api_key_from(args.api_key, os.environ),
        max_queued_requests=args.max_queued_requests,
        max_request_sequences=args.max_request_sequences,
        request_timeout=args.request_timeout,
        max_request_bytes=args.max_request_bytes,
        batch_dir=args.batch_dir,
        max_batch_concurrency=args.max_batch_concurrency or DEFAULT_BATCH_CONCURRENCY,
        max_file_bytes=args.max_file_bytes,
        drain_timeout=args.drain_timeout,
        register=args.register,
        advertise_url=args.advertise_url,
        log_level=args.log_level,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        responses_store=args.responses_store,
        responses_store_max_bytes=args.responses_store_max_bytes,
        responses_store_ttl=args.responses_store_ttl,
        responses_lease_ttl=args.responses_lease_ttl,
        lora_modules=lora_modules,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        trust_request_chat_template=args.trust_request_chat_template,
        chat=chat_defaults(args),
        response_role=args.response_role,
        tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
        media=media_options(args),
        http=http_options(args),
    )
