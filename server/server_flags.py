"""The server's own `ferry serve` flags: what it serves and where, auth, registration, request and
queue limits, the Files/Batches and Responses stores, LoRA modules, chat templates, media, tool and
reasoning parsers (``add_server_flags``); and ``human_int``, the type of every size flag.

``server/args.py`` assembles them with the engine's (``server/engine_flags.py``) and vLLM's names
(``server/vllm_flags.py``) into ``add_serve_args``. Imported by ``ferry --help``: it must stay
torch-free.
"""

from __future__ import annotations

import argparse
from decimal import Decimal

from server.http_limits import add_header_timeout_arg

# The names in the registries of server/tool_parsers.py and server/reasoning_parsers.py (kept
# here: this module must stay light).
TOOL_PARSER_NAMES = (
    "deepseek_v3",
    "deepseek_v31",
    "deepseek_v32",
    "ernie45",
    "functiongemma",
    "gigachat3",
    "glm45",
    "glm47",
    "granite",
    "granite-20b-fc",
    "granite4",
    "hermes",
    "hunyuan_a13b",
    "internlm",
    "jamba",
    "kimi_k2",
    "llama3_json",
    "llama4_json",
    "llama4_pythonic",
    "longcat",
    "mimo",
    "minimax",
    "minimax_m2",
    "mistral",
    "olmo3",
    "openai",
    "phi4_mini_json",
    "pythonic",
    "qwen3_coder",
    "qwen3_xml",
    "seed_oss",
    "step3",
    "step3p5",
    "xlam",
)
REASONING_PARSER_NAMES = (
    "deepseek_r1",
    "deepseek_v3",
    "ernie45",
    "glm45",
    "glm47",
    "granite",
    "holo2",
    "hunyuan_a13b",
    "kimi_k2",
    "mimo",
    "minimax_m2",
    "minimax_m2_append_think",
    "mistral",
    "nemotron_v3",
    "olmo3",
    "openai_gptoss",
    "qwen3",
    "seed_oss",
    "step3",
    "step3p5",
)


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


def add_server_flags(p: argparse.ArgumentParser) -> None:
    """The server's flags, in ``--help``'s order."""
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
        "--lora-resolver-dir",
        default=None,
        metavar="DIR",
        help="load a LoRA adapter a request names but this server does not serve from DIR/<name>, "
        "on first use (vLLM's filesystem resolver; its VLLM_LORA_RESOLVER_CACHE_DIR does the same); "
        "needs --enable-lora and --allow-runtime-lora-updating",
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
        help="split a reasoning model's <think>…</think> (mistral: [THINK]…[/THINK]; gpt-oss: its "
        "analysis channel) into reasoning_content: deepseek_r1, qwen3, openai_gptoss, mistral, …",
    )
