"""`ferry serve` flags (DESIGN.md names): ``add_serve_args``, and what is built from them.

The flags themselves are grouped by concern: the server's own (``server/server_flags.py``), the
engine's (``server/engine_flags.py``: 1:1 with ``EngineConfig`` fields, ``--num-kv-blocks`` ->
``num_kv_blocks``) and vLLM's names (``server/vllm_flags.py``). ``engine_options(args)`` picks the
engine's by field name, so a new EngineConfig field only needs a flag and can never drift.
Everything else is the server's (``server_config(args)``). This module is imported by
``ferry --help``; it must stay torch-free.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig
from server.engine_flags import add_engine_flags
from server.server_flags import add_server_flags
from server.tracing import add_tracing_args
from server.vllm_flags import add_vllm_args, http_options

if TYPE_CHECKING:
    from engine.media import MediaOptions
    from server.config import ServerConfig

DEMO_MODEL_NAME = "ferry-demo"
DEFAULT_BATCH_CONCURRENCY = 8  # batch requests at once in `ferry serve`: a modest share of the engine


def add_serve_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every `ferry serve` flag, in ``--help``'s order: the server's, the engine's, vLLM's names."""
    add_server_flags(p)
    add_engine_flags(p)
    add_vllm_args(p)
    add_tracing_args(p)
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


def lora_resolver_dir(args: argparse.Namespace) -> str | None:
    """``--lora-resolver-dir``, or vLLM's ``VLLM_LORA_RESOLVER_CACHE_DIR`` (``server/lora_resolver.py``).
    Like vLLM's resolvers it needs runtime LoRA updating: the flag without it (or without
    --enable-lora) is a ValueError; the environment variable without it is ignored, as vLLM ignores it."""
    from server.lora import runtime_updating_allowed
    from server.lora_resolver import RESOLVER_DIR_ENV, resolver_dir

    flag = getattr(args, "lora_resolver_dir", None)  # run-batch has no such flag
    directory = resolver_dir(flag)
    if directory is None:
        return None
    ready = args.enable_lora and runtime_updating_allowed(args.allow_runtime_lora_updating)
    if flag is None:
        if not ready:
            logging.getLogger("ferry.server").warning(
                "%s is set, but LoRA adapters are not resolved from it without --enable-lora and "
                "--allow-runtime-lora-updating",
                RESOLVER_DIR_ENV,
            )
            return None
        return directory
    if not ready:
        raise ValueError("--lora-resolver-dir needs --enable-lora and --allow-runtime-lora-updating")
    return directory


def server_config(args: argparse.Namespace) -> ServerConfig:
    """Raises ValueError for flags that contradict each other or do not parse."""
    from server.chat_defaults import chat_defaults
    from server.config import ServerConfig, api_key_from
    from server.lora import parse_lora_modules

    lora_modules = parse_lora_modules(args.lora_modules)
    if lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    resolver = lora_resolver_dir(args)
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
        lora_resolver_dir=resolver,
        trust_request_chat_template=args.trust_request_chat_template,
        chat=chat_defaults(args),
        response_role=args.response_role,
        tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
        media=media_options(args),
        http=http_options(args),
        otlp_traces_endpoint=getattr(args, "otlp_traces_endpoint", None),
    )
