"""The router's configuration: one frozen dataclass built once from the CLI (or by tests)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields

from engine.chat_template import resolve_chat_template
from server.chat_defaults import ChatDefaults, template_kwargs_flag
from server.http_limits import DEFAULT_HEADER_TIMEOUT, DEFAULT_MAX_HEAD_BYTES

# Where `--enable-trace` without `--otlp-traces-endpoint` exports (an OTLP collector's grpc port here).
DEFAULT_OTLP_ENDPOINT = "http://localhost:4317"


@dataclass(frozen=True)
class RouterConfig:
    replicas: tuple[str, ...] = ()
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    policy: str = "cache_aware"
    kv_tier: str | None = None
    discovery: str | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    uds: str | None = None  # listen on this Unix socket instead of host:port (ferry serve's --uds)
    root_path: str = ""  # the path prefix a proxy in front adds (ferry serve's --root-path)
    api_key: str | None = None
    # The key replicas behind --api-key want (default: api_key): the router sends it on its own
    # reads of them and in place of the client's on what it relays.
    replica_api_key: str | None = None
    # https replicas (ferry serve --ssl-certfile): the CA file their certificates are checked
    # against (None: the system's trusted CAs)
    replica_ca_certs: str | None = None
    # CORS, as ferry serve's (server/vllm_flags.py): any origin by default
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    # cache_aware
    model: str | None = None
    # The replicas' --chat-template (held as the template's text) and content format, so the
    # router renders chats into the same tokens.
    chat_template: str | None = None
    chat_template_content_format: str = "auto"
    # The replicas' --default-chat-template-kwargs (JSON text) and --exclude-tools-when-tool-choice-none
    # (server/chat_defaults.py), for the same reason.
    default_chat_template_kwargs: str | None = None
    exclude_tools_when_tool_choice_none: bool = False
    block_size: int = 16
    balance_abs_threshold: int = 16
    load_penalty_tokens: int = 64
    decode_penalty_tokens: int = 0
    prefix_index_size: int = 1 << 20
    # limits
    max_request_bytes: int = 16 << 20
    max_file_bytes: int = 100 << 20  # POST /v1/files: a batch's input (the replica's default bound)
    # a request head's bytes, and seconds for it (and again for its body): server/http_limits.py
    max_header_bytes: int = DEFAULT_MAX_HEAD_BYTES
    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    max_concurrency: int = 1024
    max_queue: int = 1024
    queue_timeout: float = 30.0
    request_timeout: float = 600.0
    # health and failure
    health_interval: float = 1.0
    health_timeout: float = 2.0
    connect_timeout: float = 2.0
    max_retries: int = 2
    max_failovers: int = 2
    circuit_failures: int = 3
    circuit_cooldown: float = 5.0
    discovery_interval: float = 1.0
    drain_timeout: float = 30.0  # SIGTERM: stop accepting, let in-flight streams finish this long
    log_level: str = "warning"
    otlp_traces_endpoint: str | None = None  # OpenTelemetry spans (router/tracing.py)

    def __post_init__(self) -> None:
        if self.replica_api_key is not None:
            from server.config import check_api_key

            check_api_key(self.replica_api_key, "--replica-api-key")
        if self.block_size <= 0:
            raise ValueError("--block-size must be positive")
        if self.max_concurrency < 1 or self.max_queue < 0:
            raise ValueError("--max-concurrency must be >= 1 and --max-queue >= 0")
        if self.load_penalty_tokens < 0 or self.decode_penalty_tokens < 0:
            raise ValueError("--load-penalty-tokens and --decode-penalty-tokens must be >= 0")
        if self.max_retries < 0 or self.max_failovers < 0:
            raise ValueError("--max-retries and --max-failovers must be >= 0")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        if self.max_request_bytes < 1 or self.max_header_bytes < 1 or self.max_file_bytes < 1:
            raise ValueError("--max-request-bytes, --max-header-bytes and --max-file-bytes must be positive")
        for flag, value in (
            ("--queue-timeout", self.queue_timeout),
            ("--header-timeout", self.header_timeout),
            ("--request-timeout", self.request_timeout),
            ("--health-interval", self.health_interval),
            ("--health-timeout", self.health_timeout),
            ("--connect-timeout", self.connect_timeout),
            ("--discovery-interval", self.discovery_interval),
        ):
            if not value > 0:
                raise ValueError(f"{flag} must be positive, got {value}")
        if self.circuit_failures < 1 or self.circuit_cooldown < 0 or self.drain_timeout < 0:
            raise ValueError("--circuit-failures must be >= 1, --circuit-cooldown and --drain-timeout >= 0")
        if self.replica_ca_certs is not None and not os.path.isfile(self.replica_ca_certs):
            raise ValueError(f"--replica-ca-certs: no such file: {self.replica_ca_certs}")
        if self.uds is not None and not os.path.isdir(os.path.dirname(os.path.abspath(self.uds))):
            raise ValueError(f"--uds: no such directory for the socket: {os.path.dirname(self.uds)}")
        if self.chat_template is not None:
            object.__setattr__(self, "chat_template", resolve_chat_template(self.chat_template))
        template_kwargs_flag(self.default_chat_template_kwargs)  # a bad value stops the start
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise ValueError(f"--root-path must start with '/' and not end with one, got {self.root_path!r}")

    @property
    def chat_defaults(self) -> ChatDefaults:
        return ChatDefaults(
            template_kwargs_flag(self.default_chat_template_kwargs), self.exclude_tools_when_tool_choice_none
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RouterConfig:
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in vars(args).items() if k in names}
        values["replicas"] = tuple(getattr(args, "replica", []) or [])
        for key in ("allowed_origins", "allowed_methods", "allowed_headers"):
            if key in values:
                values[key] = tuple(values[key])
        for key in ("prefill", "decode"):
            values[key] = tuple(values.get(key) or [])
        from server.config import api_key_from  # (pydantic models: not at the router's import)

        values["api_key"] = api_key_from(values.get("api_key"), os.environ)
        if getattr(args, "enable_trace", False) and values.get("otlp_traces_endpoint") is None:
            values["otlp_traces_endpoint"] = DEFAULT_OTLP_ENDPOINT  # sglang-router's --enable-trace
        return cls(**values)
