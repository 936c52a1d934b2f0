"""Server configuration: one frozen dataclass, built once from the `ferry serve` flags."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass

from engine.media import MediaOptions
from server.chat_defaults import ChatDefaults
from server.protocol import MAX_N
from server.vllm_flags import HttpOptions

# Where an API key comes from when no --api-key is given (`ferry serve` and `ferry router` alike, so
# a router started in the replicas' environment sends them the key they want): ferry's variable,
# then vLLM's (its servers read VLLM_API_KEY). A secret in the environment stays out of `ps`.
API_KEY_ENVS = ("FERRY_API_KEY", "VLLM_API_KEY")


def api_key_from(flag: str | None, environ: Mapping[str, str]) -> str | None:
    """The flag's key, else the first non-empty ``API_KEY_ENVS`` variable, else None. ValueError
    for a key no HTTP client can send (``check_api_key``)."""
    if flag:
        return check_api_key(flag, "--api-key")
    name = next((name for name in API_KEY_ENVS if environ.get(name)), None)
    return None if name is None else check_api_key(environ[name], name)


def check_api_key(key: str, source: str) -> str:
    """``key`` when a client can send it in an ``Authorization`` header: printable ASCII, no
    whitespace at either end (HTTP clients encode header values as ASCII, parsers strip the
    ends). Else ValueError naming ``source``: every guarded request would fail (a 500 or a 401)."""
    if not key.isascii() or not key.isprintable() or key != key.strip():
        raise ValueError(
            f"{source} must be printable ASCII without leading or trailing spaces "
            "(a client sends it in an HTTP header)"
        )
    return key


@dataclass(frozen=True)
class ServerConfig:
    """Everything the HTTP layer decides; engine options live in ``engine.config.EngineConfig``."""

    served_model_name: str = "ferry-demo"
    # More names clients may send (--served-model-name a b ...); answers carry served_model_name.
    model_aliases: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8000
    role: str = "mixed"  # mixed | prefill | decode
    api_key: str | None = None
    max_queued_requests: int = 256  # engine sequences waiting beyond which new requests get 429
    # Most sequences (prompts x n) one completions request may ask for: a body within
    # max_request_bytes can hold two million one-token prompts, ~14 KB of server memory each.
    max_request_sequences: int = 16384
    request_timeout: float | None = None  # seconds; None: no limit
    max_request_bytes: int = 8 * 1024 * 1024
    # The Files and Batches API (server/batch_api.py): its directory (None: a temporary one), the
    # batch requests running at once across all batches, the largest upload.
    batch_dir: str | None = None
    max_batch_concurrency: int = 8
    max_file_bytes: int = 100 * 1024 * 1024
    drain_timeout: float = 30.0  # seconds to finish in-flight requests after SIGTERM
    max_n: int = MAX_N
    register: str | None = None  # redis://… to announce this replica in
    advertise_url: str | None = None  # the URL routers should use; default http://host:port
    register_interval: float = 2.0  # heartbeat period (seconds)
    register_ttl: float = 6.0  # heartbeat key TTL (seconds)
    log_level: str = "info"
    # tool_choice "auto": the model's own call format, read by this parser (server/tool_parsers.py)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None  # split <think>…</think> into reasoning_content
    # Stored /v1/responses (server/responses_store.py): memory | none | redis://…
    responses_store: str = "memory"
    responses_store_max_bytes: int = 256 * 1024 * 1024
    responses_store_ttl: float = 30 * 24 * 3600.0
    # A background response's lease (server/responses_lease.py): how long after the process running
    # it last renewed it (every fifth of this) a reader reports the response failed.
    responses_lease_ttl: float = 5.0
    # LoRA adapters served from the start (--lora-modules; engine.lora_request.LoRARequest), and
    # whether /v1/load_lora_adapter and /v1/unload_lora_adapter may change them.
    lora_modules: tuple = ()
    allow_runtime_lora_updating: bool = False
    # Adapters loaded on first use from this directory (--lora-resolver-dir; server/lora_resolver.py)
    lora_resolver_dir: str | None = None
    # Requests may carry their own chat_template (vLLM's --trust-request-chat-template).
    trust_request_chat_template: bool = False
    # Template variables every chat gets and tool_choice "none" hiding tools (server/chat_defaults.py)
    chat: ChatDefaults = ChatDefaults()
    # The role chat completions answer with (vLLM's --response-role)
    response_role: str = "assistant"
    # GET /tokenizer_info (vLLM's --enable-tokenizer-info-endpoint)
    tokenizer_info_endpoint: bool = False
    # Image inputs (engine/media.py): --allowed-local-media-path, --limit-mm-per-prompt
    media: MediaOptions = MediaOptions()
    # CORS, TLS, root path (vLLM's HTTP flags: server/vllm_flags.py)
    http: HttpOptions = HttpOptions()
    # OpenTelemetry: each API server process exports its requests' spans here (server/tracing.py)
    otlp_traces_endpoint: str | None = None

    @property
    def url(self) -> str:
        """Where routers reach this replica (a wildcard bind host is replaced by this host's address)."""
        if self.advertise_url:
            return self.advertise_url.rstrip("/")
        host = self.host
        if host in ("0.0.0.0", "::", ""):
            try:
                host = socket.gethostbyname(socket.gethostname())
            except OSError:
                host = "127.0.0.1"
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        scheme = "https" if self.http.tls else "http"
        return f"{scheme}://{host}:{self.port}"
