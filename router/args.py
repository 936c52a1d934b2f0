"""`ferry router` flags (DESIGN.md names first, then the router's own tuning flags)."""

from __future__ import annotations

import argparse

from router.pd_config import add_pd_args
from router.policies.registry import POLICY_NAMES
from server.chat_defaults import add_chat_default_args
from server.http_limits import DEFAULT_MAX_HEAD_BYTES, add_header_timeout_arg
from server.vllm_flags import json_list

POLICIES = list(POLICY_NAMES)


def add_router_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--replica", action="append", default=[], help="mixed replica URL (repeatable)")
    p.add_argument("--prefill", action="append", default=[], help="prefill worker URL (repeatable)")
    p.add_argument("--decode", action="append", default=[], help="decode worker URL (repeatable)")
    p.add_argument("--policy", choices=POLICIES, default="cache_aware")
    p.add_argument("--kv-tier", default=None)
    p.add_argument("--discovery", default=None, help="redis://… | k8s:… | dns:…")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument(
        "--uds", default=None, metavar="PATH", help="listen on this Unix socket instead of host:port"
    )
    p.add_argument(
        "--root-path",
        default="",
        help="the path prefix a proxy in front adds: routes and the API key match with or without it",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="Bearer key for the /admin API (and /v1 when set; default: $FERRY_API_KEY, else $VLLM_API_KEY)",
    )
    p.add_argument(
        "--allowed-origins",
        type=json_list,
        default=["*"],
        help='CORS origins (JSON list; default ["*"], as vLLM\'s)',
    )
    p.add_argument("--allowed-methods", type=json_list, default=["*"], help="CORS methods (JSON list)")
    p.add_argument("--allowed-headers", type=json_list, default=["*"], help="CORS headers (JSON list)")
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    p.add_argument(
        "--replica-ca-certs",
        default=None,
        help="CA file that https:// replicas' certificates are checked against (default: the system's CAs)",
    )
    p.add_argument(
        "--replica-api-key",
        default=None,
        help="Bearer key of replicas started with --api-key (default: --api-key): sent on the router's "
        "own reads of them (/v1/models) and in place of the client's key on relayed requests",
    )

    g = p.add_argument_group("cache_aware policy")
    g.add_argument(
        "--model",
        default=None,
        help="tokenizer directory (tokenizer.json + chat template; no weights are read) for exact "
        "block hashes; without it cache_aware matches prefixes of the request text",
    )
    g.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|TEMPLATE",
        help="the replicas' --chat-template, when they serve one (chats are keyed as they render them)",
    )
    g.add_argument(
        "--chat-template-content-format",
        default="auto",
        choices=["auto", "string", "openai"],
        help="the replicas' --chat-template-content-format",
    )
    add_chat_default_args(g, router=True)
    g.add_argument("--block-size", type=int, default=16, help="KV block size of the replicas")
    g.add_argument(
        "--balance-abs-threshold",
        type=int,
        default=16,
        help="cache_aware falls back to least load when the prefix holder has this many more "
        "in-flight requests than the least loaded replica",
    )
    g.add_argument(
        "--load-penalty-tokens",
        type=int,
        default=64,
        help="cache_aware score: prompt tokens of predicted cache hit worth one request the replica has "
        "waiting for its first token (queued or prefilling)",
    )
    g.add_argument(
        "--decode-penalty-tokens",
        type=int,
        default=0,
        help="cache_aware score: prompt tokens of predicted cache hit worth one request the replica is "
        "decoding (streamed requests past their first token; --balance-abs-threshold still caps them)",
    )
    g.add_argument(
        "--prefix-index-size", type=int, default=1 << 20, help="block-hash entries remembered (LRU)"
    )

    add_pd_args(p)

    g = p.add_argument_group("limits")
    g.add_argument("--max-request-bytes", type=int, default=16 << 20, help="largest request body")
    g.add_argument(
        "--max-file-bytes",
        type=int,
        default=100 << 20,
        help="largest body of a file upload (POST /v1/files: a batch's input, a replica's own "
        "--max-file-bytes by default), instead of --max-request-bytes",
    )
    g.add_argument(
        "--max-header-bytes",
        type=int,
        default=DEFAULT_MAX_HEAD_BYTES,
        help="most bytes of a request head (request line and headers): a larger one gets 431 before it "
        "is buffered whole",
    )
    add_header_timeout_arg(g)
    g.add_argument("--max-concurrency", type=int, default=1024, help="requests relayed at once")
    g.add_argument("--max-queue", type=int, default=1024, help="requests waiting for a slot; beyond: 429")
    g.add_argument("--queue-timeout", type=float, default=30.0, help="seconds a request may wait for a slot")
    g.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds without a byte from a replica"
    )

    g = p.add_argument_group("health and failure")
    g.add_argument("--health-interval", type=float, default=1.0, help="seconds between /health probes")
    g.add_argument("--health-timeout", type=float, default=2.0)
    g.add_argument("--connect-timeout", type=float, default=2.0)
    g.add_argument("--max-retries", type=int, default=2, help="re-sends to other replicas before any byte")
    g.add_argument("--max-failovers", type=int, default=2, help="mid-stream resumes on other replicas")
    g.add_argument("--circuit-failures", type=int, default=3, help="consecutive failures that open a circuit")
    g.add_argument("--circuit-cooldown", type=float, default=5.0, help="seconds a circuit stays open")
    g.add_argument("--discovery-interval", type=float, default=1.0)
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds in-flight requests may take before the router exits",
    )
    g.add_argument("--log-level", default="warning")
    g = p.add_argument_group("tracing")
    g.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="export an OpenTelemetry span per routed request (a child of its traceparent; replicas "
        "get its context) to this OTLP collector: grpc (http://host:4317) or, with "
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf, http://host:4318/v1/traces",
    )
    g.add_argument(
        "--enable-trace",
        action="store_true",
        help="sglang-router's switch: trace, to --otlp-traces-endpoint or http://localhost:4317",
    )
    return p
