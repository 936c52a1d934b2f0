"""`vllm serve` flags a command line carries over to `ferry serve`.

What it adds (this module must stay torch-free: ``ferry --help`` imports it):

* Request logging as vLLM's (``--enable-log-requests``, ``--max-log-len``; ``--disable-log-requests``
  is the default): one INFO line per admitted generation request (``log_request``).
* HTTP options ferry serves as vLLM does: CORS (``--allowed-origins``, ``--allowed-methods``,
  ``--allowed-headers``, ``--allow-credentials``; vLLM's defaults let any origin in), TLS
  (``--ssl-keyfile``, ``--ssl-certfile``, ``--ssl-ca-certs``, ``--ssl-cert-reqs``),
  ``--uvicorn-log-level``, ``--root-path`` (the app's root path behind a proxy that adds a path
  prefix: routes and the API key match with or without it), ``--disable-fastapi-docs``, ``--uds``
  (a Unix socket instead of host:port) and two server-wide request defaults,
  ``--return-tokens-as-token-ids`` and ``--enable-force-include-usage`` (``apply_request_defaults``),
  and ``--stream-interval`` (tokens per streamed chunk);
  gathered into ``HttpOptions`` (``ServerConfig.http``).
* Model-loading options, ``EngineConfig`` fields by name (``server.args.engine_options``):
  ``--tokenizer``, ``--tokenizer-mode``, ``--hf-overrides``, ``--quantization`` / ``-q`` and
  ``--load-format``; their values are checked by the engine (``engine/config.py``).
* Chat options: ``--response-role``, ``--enable-tokenizer-info-endpoint``, ``--allowed-media-domains``
  (into ``MediaOptions``), the chat rendering defaults of ``server/chat_defaults.py`` and the
  structured-output backend flags (``server/vllm_compat.py``); ``--revision``,
  ``--tokenizer-revision`` and ``--download-dir`` for hub ids (EngineConfig fields);
  ``--enable-log-outputs`` (``log_output``), ``--disable-uvicorn-access-log`` and
  ``--h11-max-incomplete-event-size``.
* Flags ferry accepts without acting on them, or refuses: ``server/vllm_compat.py``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from server.chat_defaults import add_chat_default_args
from server.http_limits import DEFAULT_HEADER_TIMEOUT, DEFAULT_MAX_HEAD_BYTES, HttpLimits, uvicorn_options
from server.protocol import StreamOptions
from server.vllm_compat import add_compat_args, add_structured_output_args


@dataclass(frozen=True)
class HttpOptions:
    """CORS, TLS (uvicorn and Starlette's CORSMiddleware) and request-logging options of the API server."""

    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0  # ssl.CERT_NONE; 2 (CERT_REQUIRED) asks clients for certificates
    log_requests: bool = False  # --enable-log-requests
    log_outputs: bool = False  # --enable-log-outputs (with --enable-log-requests)
    max_log_len: int | None = None  # --max-log-len
    access_log: bool = True  # uvicorn's access log at --log-level debug (--disable-uvicorn-access-log: never)
    # The most bytes of a request head (request line and headers) buffered: past them, 431. vLLM's
    # flag name, for h11's limit; ferry's protocols set it under httptools too (server/http_limits.py).
    h11_max_incomplete_event_size: int = DEFAULT_MAX_HEAD_BYTES
    header_timeout: float = DEFAULT_HEADER_TIMEOUT  # --header-timeout (server/http_limits.py)
    uvicorn_log_level: str | None = None  # None: --log-level
    root_path: str = ""  # --root-path: FastAPI's root_path (a path-prefixing proxy in front)
    docs: bool = True  # /docs, /redoc and /openapi.json (--disable-fastapi-docs: none)
    uds: str | None = None  # --uds: listen on this Unix socket instead of host:port
    # Server-wide request defaults: logprob tokens as "token_id:N" where a request does not say
    # (--return-tokens-as-token-ids), and usage at the end of every stream (--enable-force-include-usage).
    return_tokens_as_token_ids: bool = False
    force_include_usage: bool = False
    # --stream-interval: a stream's chunks carry at least this many tokens (the first and last at
    # once); a request's stream_interval may raise it (server.params.sampling_params).
    stream_interval: int = 1

    @property
    def tls(self) -> bool:
        return self.ssl_certfile is not None

    def uvicorn_kwargs(self) -> dict:
        """What ``uvicorn.Config`` takes of these options."""
        kwargs: dict = {}
        if self.tls:
            kwargs.update(
                ssl_keyfile=self.ssl_keyfile,
                ssl_certfile=self.ssl_certfile,
                ssl_ca_certs=self.ssl_ca_certs,
                ssl_cert_reqs=self.ssl_cert_reqs,
            )
        if self.uvicorn_log_level is not None:
            kwargs["log_level"] = self.uvicorn_log_level
        if self.uds is not None:
            kwargs["uds"] = self.uds
        # uvicorn's own parser choice (httptools when installed), with the head limit and timeout
        kwargs.update(uvicorn_options(HttpLimits(self.header_timeout, self.h11_max_incomplete_event_size)))
        return kwargs

    def fastapi_kwargs(self) -> dict:
        """What ``FastAPI(...)`` takes of these options (vLLM's docs switch; the root path is set on
        the app after it is built: ``build_app``)."""
        kwargs: dict = {}
        if not self.docs:
            kwargs.update(openapi_url=None, docs_url=None, redoc_url=None)
        return kwargs


def json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


def add_vllm_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("vLLM's HTTP and logging options")
    g.add_argument(
        "--allowed-origins", type=json_list, default=["*"], help='CORS origins (JSON list; default ["*"])'
    )
    g.add_argument("--allowed-methods", type=json_list, default=["*"], help="CORS methods (JSON list)")
    g.add_argument("--allowed-headers", type=json_list, default=["*"], help="CORS headers (JSON list)")
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    g.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key")
    g.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate")
    g.add_argument("--ssl-ca-certs", default=None, help="CA certificates to check client certificates with")
    g.add_argument(
        "--ssl-cert-reqs", type=int, default=0, help="client certificates: 0 none, 1 optional, 2 required"
    )
    g.add_argument(
        "--uvicorn-log-level",
        default=None,
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's own log level (default: --log-level)",
    )
    g.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="log each generation request (id, model, prompt, parameters) at INFO",
    )
    g.add_argument("--disable-log-requests", action="store_true", help="do not log requests (the default)")
    g.add_argument(
        "--enable-log-outputs",
        action="store_true",
        help="with --enable-log-requests, also log each sequence's output (text, token ids, finish "
        "reason) when it ends, streamed or not",
    )
    g.add_argument(
        "--disable-uvicorn-access-log",
        action="store_true",
        help="no access log line per HTTP request (ferry writes them only at --log-level debug)",
    )
    g.add_argument(
        "--h11-max-incomplete-event-size",
        type=int,
        default=DEFAULT_MAX_HEAD_BYTES,
        metavar="BYTES",
        help="most bytes of a request head (request line and headers) buffered while it arrives: a "
        "larger head gets 431 and the connection closes (default: %(default)d)",
    )
    g.add_argument(
        "--max-log-len",
        type=int,
        default=None,
        help="most prompt characters (or token ids) a request's log line shows (default: all)",
    )
    g.add_argument(
        "--root-path",
        default="",
        help="the path prefix a proxy in front adds (FastAPI's root_path): routes and the API key "
        "match with or without it, the OpenAPI docs name it",
    )
    g.add_argument(
        "--disable-fastapi-docs", action="store_true", help="serve no /docs, /redoc or /openapi.json"
    )
    g.add_argument(
        "--uds", default=None, metavar="PATH", help="listen on this Unix socket instead of host:port"
    )
    g.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help='logprob tokens as "token_id:N" for requests that do not set return_tokens_as_token_ids',
    )
    g.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        metavar="N",
        help="tokens per streamed chunk (the first and last are sent at once); a request's "
        "stream_interval may raise it",
    )
    g.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="every stream ends with a usage chunk, as if stream_options.include_usage were set",
    )
    c = p.add_argument_group("vLLM's chat options")
    c.add_argument(
        "--response-role",
        default="assistant",
        metavar="ROLE",
        help="the role chat completions answer with when the prompt asks for a new turn "
        "(add_generation_prompt, the default; otherwise the continued message's role)",
    )
    add_chat_default_args(c)
    c.add_argument(
        "--enable-tokenizer-info-endpoint",
        action="store_true",
        help="serve GET /tokenizer_info: the tokenizer's configuration (tokenizer_config.json, its class "
        "and the chat template served)",
    )
    c.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=None,
        metavar="DOMAIN",
        help="image URLs (http/https) are fetched only from these host names (redirects included); "
        "others get a 400 before any fetch (default: any)",
    )
    add_structured_output_args(c)
    m = p.add_argument_group("vLLM's model-loading options")
    m.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="read the tokenizer, chat template and special tokens from this directory (or hub id) "
        "instead of the model's",
    )
    m.add_argument(
        "--tokenizer-mode",
        default="auto",
        help="auto or hf: the fast tokenizer (slow and mistral are not served)",
    )
    m.add_argument(
        "--hf-overrides",
        default=None,
        metavar="JSON",
        help="a JSON object merged over the model's config.json before it is read, e.g. "
        "'{\"max_position_embeddings\": 4096}'",
    )
    m.add_argument(
        "--quantization",
        "-q",
        default=None,
        metavar="METHOD",
        help="the method the checkpoint is quantized with (gptq, awq, compressed-tensors, fp8; "
        "gptq_marlin and awq_marlin name the first two): a checkpoint that is not is refused",
    )
    m.add_argument(
        "--revision",
        default=None,
        help="a hub id's branch, tag or commit to download (default: main)",
    )
    m.add_argument(
        "--tokenizer-revision",
        default=None,
        help="the tokenizer's branch, tag or commit, for a hub id (default: --revision)",
    )
    m.add_argument(
        "--download-dir",
        default=None,
        metavar="DIR",
        help="where hub ids are downloaded and looked up (default: the Hugging Face cache)",
    )
    m.add_argument(
        "--load-format",
        default="auto",
        help="auto or safetensors: the checkpoint's weights; dummy: random weights, no weight file read",
    )
    add_compat_args(p)


def http_options(args: argparse.Namespace) -> HttpOptions:
    """Raises ValueError for TLS options that do not go together (or a negative --max-log-len)."""
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ValueError(f"--max-log-len must be >= 0, got {args.max_log_len}")
    size = args.h11_max_incomplete_event_size
    if size < 1:
        raise ValueError(f"--h11-max-incomplete-event-size must be positive, got {size}")
    if not args.header_timeout > 0:
        raise ValueError(f"--header-timeout must be positive, got {args.header_timeout}")
    if args.stream_interval < 1:
        raise ValueError(f"--stream-interval must be at least 1, got {args.stream_interval}")
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together")
    if args.ssl_cert_reqs not in (0, 1, 2):
        raise ValueError(f"--ssl-cert-reqs must be 0, 1 or 2, got {args.ssl_cert_reqs}")
    root = args.root_path
    if root and (not root.startswith("/") or root.endswith("/")):
        raise ValueError(f"--root-path must start with / and not end with one (e.g. /api), got {root!r}")
    if args.uds is not None and args.register is not None and args.advertise_url is None:
        raise ValueError("--uds with --register needs --advertise-url: routers cannot reach a Unix socket")
    if args.uds is not None and args.ssl_certfile is not None:
        raise ValueError("--uds serves plain HTTP on a Unix socket: leave out --ssl-keyfile/--ssl-certfile")
    for flag, path in (
        ("--ssl-keyfile", args.ssl_keyfile),
        ("--ssl-certfile", args.ssl_certfile),
        ("--ssl-ca-certs", args.ssl_ca_certs),
    ):
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"{flag}: no such file: {path}")
    if args.uds is not None and not os.path.isdir(os.path.dirname(os.path.abspath(args.uds))):
        raise ValueError(f"--uds: no such directory for the socket: {os.path.dirname(args.uds)}")
    return HttpOptions(
        allowed_origins=tuple(args.allowed_origins),
        allowed_methods=tuple(args.allowed_methods),
        allowed_headers=tuple(args.allowed_headers),
        allow_credentials=args.allow_credentials,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
        uvicorn_log_level=args.uvicorn_log_level,
        log_requests=args.enable_log_requests and not args.disable_log_requests,
        log_outputs=args.enable_log_outputs and args.enable_log_requests and not args.disable_log_requests,
        max_log_len=args.max_log_len,
        access_log=not args.disable_uvicorn_access_log,
        h11_max_incomplete_event_size=size,
        header_timeout=args.header_timeout,
        root_path=root,
        docs=not args.disable_fastapi_docs,
        uds=args.uds,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        force_include_usage=args.enable_force_include_usage,
        stream_interval=args.stream_interval,
    )


def log_request(
    logger: logging.Logger, options: HttpOptions, request_id: str, model: str, prompt: object, params: object
) -> None:
    """vLLM's request log line (``--enable-log-requests``): the prompt (text, or token ids) cut to
    ``--max-log-len``, and the sampling parameters of its first sequence."""
    if not options.log_requests:
        return
    shown = prompt[: options.max_log_len] if options.max_log_len is not None else prompt  # type: ignore[index]
    logger.info("Received request %s: model: %s, prompt: %r, params: %s", request_id, model, shown, params)


def log_output(
    logger: logging.Logger,
    options: HttpOptions,
    request_id: str,
    text: str,
    token_ids: list[int],
    reason: str,
) -> None:
    """vLLM's output log line (``--enable-log-outputs``): a sequence's text and token ids, each cut
    to ``--max-log-len``, and why it ended."""
    if options.max_log_len is not None:
        text, token_ids = text[: options.max_log_len], token_ids[: options.max_log_len]
    logger.info(
        "Generated response %s: output: %r, output_token_ids: %s, finish_reason: %s",
        request_id,
        text,
        token_ids,
        reason,
    )


def apply_request_defaults(request: Any, options: HttpOptions) -> None:
    """The server-wide defaults of a chat or completion request, as vLLM applies them: logprob tokens
    as ids unless the request says otherwise; with forced usage, a stream's usage chunk (continuous
    usage stays the request's choice)."""
    if options.return_tokens_as_token_ids and "return_tokens_as_token_ids" not in request.model_fields_set:
        request.return_tokens_as_token_ids = True
    if options.force_include_usage and request.stream:
        if request.stream_options is None:
            request.stream_options = StreamOptions(include_usage=True)
        else:
            request.stream_options.include_usage = True
