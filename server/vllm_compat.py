"""`vllm serve` flags ferry accepts without acting on them, or refuses: a vLLM command line starts as
`ferry serve` and says at once what differs. Torch-free (``ferry --help`` imports it).

* ``COMPAT_FLAGS``: for what ferry does anyway or has no use for; accepted, each logged once with
  what ferry does instead (``compat_notes``).
* ``LIMITED_FLAGS``: accepted at the values ferry honours (logged like the compatibility flags when
  given), refused at start with one line at any other (``limited_problem``): the parallelism flags
  above 1, ``--preemption-mode swap``, ``--cpu-offload-gb`` above 0, and flags whose feature ferry does not
  have (KV connectors, logits-processor plugins, headless engines, no tokenizer).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from server.tracing import tracing_notes

_SWITCH: dict[str, Any] = {"action": "store_true"}

# engine/image_processor.py's cache, of a fixed size (PROCESSED_CACHE_SIZE; not imported: torch-free).
_IMAGE_CACHE = "the last 32 images read from bytes are kept processed, by their bytes' digest"

# Accepted for compatibility: flag -> (argparse options, what ferry does instead).
COMPAT_FLAGS: dict[str, tuple[dict, str]] = {
    "--enforce-eager": (_SWITCH, "ferry captures no CUDA graphs; every step runs eagerly"),
    "--enable-chunked-prefill": (
        {"action": argparse.BooleanOptionalAction, "default": None},
        "prefills are always chunked to --max-num-batched-tokens",
    ),
    "--swap-space": ({"type": float}, "preempted requests are recomputed from the prefix cache, not swapped"),
    "--disable-log-stats": (_SWITCH, "engine stats are in /metrics, never logged"),
    "--trust-remote-code": (
        _SWITCH,
        "no code from a checkpoint is ever run; architectures are ferry's own (see --help of --model)",
    ),
    "--code-revision": ({}, "no code from a checkpoint is ever run (--revision picks the checkpoint's)"),
    "--disable-frontend-multiprocessing": (_SWITCH, "see --api-server-count"),
    "--enable-prompt-tokens-details": (_SWITCH, "usage always carries cached prompt tokens"),
    "--enable-server-load-tracking": (_SWITCH, "GET /load always counts the requests"),
    "--max-seq-len-to-capture": ({"type": int}, "ferry captures no CUDA graphs"),
    "--disable-custom-all-reduce": (_SWITCH, "a replica runs on one device: there is no all-reduce"),
    "--compilation-config": ({}, "ferry does not torch.compile the model"),  # also -O (_SHORT)
    "--async-scheduling": (
        {"action": argparse.BooleanOptionalAction, "default": None},
        "the engine loop runs on its own (thread or process) beside the API",
    ),
    "--max-parallel-loading-workers": ({"type": int}, "weights are read from safetensors files in one pass"),
    "--enable-request-id-headers": (
        _SWITCH,
        "every answer carries X-Request-Id (the client's, or the one ferry made)",
    ),
    "--show-hidden-metrics-for-version": ({}, "/metrics shows all of ferry's metrics"),
    "--max-num-partial-prefills": (
        {"type": int},
        "prefills share each step's --max-num-batched-tokens; --long-prefill-token-threshold bounds "
        "one prompt's share",
    ),
    "--max-long-partial-prefills": (
        {"type": int},
        "--long-prefill-token-threshold bounds each long prompt's tokens per step",
    ),
    "--mm-processor-cache-gb": ({"type": float}, _IMAGE_CACHE),
    "--disable-mm-preprocessor-cache": (_SWITCH, _IMAGE_CACHE),
    "--enable-expert-parallel": (_SWITCH, "a replica runs on one device: experts are not split"),
    "--fully-sharded-loras": (_SWITCH, "a replica runs on one device: LoRA weights are not sharded"),
    "--lora-dtype": (
        {"choices": ["auto", "float16", "bfloat16"]},
        "LoRA adapters run in the model's dtype (--dtype), as vLLM's auto",
    ),
}
_SHORT = {"--compilation-config": "-O"}  # vLLM's -O3 and -O 3


@dataclass(frozen=True)
class Limited:
    """A flag ferry honours at some values: ``honoured(value)`` says which (None: not given);
    ``help``: the values it takes; ``note``: what ferry does, logged when given; ``refusal``: why
    other values cannot be had."""

    options: dict
    honoured: Callable[[Any], bool]
    help: str
    note: str
    refusal: str


_SCALE_OUT = (
    "a ferry replica runs on one device; scale out with data-parallel replicas behind `ferry router` "
    "(or `ferry up`)"
)


def _parallel() -> Limited:
    return Limited(
        {"type": int, "default": 1}, lambda v: v == 1, "1 only: one device per replica", "", _SCALE_OUT
    )


def _refused(options: dict, refusal: str) -> Limited:
    """A flag whose feature ferry does not have: refused whenever given."""
    return Limited(options, lambda v: v is False, f"refused: {refusal}", "", refusal)


LIMITED_FLAGS: dict[tuple[str, ...], Limited] = {
    ("--tensor-parallel-size", "-tp"): _parallel(),
    ("--pipeline-parallel-size", "-pp"): _parallel(),
    ("--data-parallel-size", "-dp"): _parallel(),
    ("--preemption-mode",): Limited(
        {"choices": ["recompute", "swap"]},
        lambda v: v == "recompute",
        "recompute only",
        "preempted requests are recomputed (from the prefix cache where their blocks remain)",
        "ferry never swaps KV blocks to host memory: preempted requests are recomputed (--preemption-mode "
        "recompute)",
    ),
    ("--cpu-offload-gb",): Limited(
        {"type": float},
        lambda v: v == 0,
        "0 only: every weight stays on the device",
        "no weights are offloaded",
        "ferry keeps every weight on the device; use a smaller or quantized checkpoint (-q), or "
        "--kv-cache-memory-bytes to leave weights more room",
    ),
    ("--kv-transfer-config",): _refused(
        {},
        "ferry moves KV blocks through its own tier, not a vLLM KV connector: use --kv-tier URL and "
        "--role prefill|decode (with `ferry router --prefill … --decode …`)",
    ),
    ("--logits-processors",): _refused(
        {"nargs": "+"},
        "ferry loads no logits-processor plugins (requests' logit_bias, bad_words … are served)",
    ),
    ("--headless",): _refused(
        _SWITCH, "a ferry replica always serves its own API; for scale-out see `ferry router`"
    ),
    ("--skip-tokenizer-init",): _refused(
        _SWITCH, "ferry needs the tokenizer (stop strings, chat templates, text output)"
    ),
}


def add_compat_args(p: argparse.ArgumentParser) -> None:
    c = p.add_argument_group(
        "vLLM flags ferry takes at some values only, or refuses (accepted ones are logged)"
    )
    for flag, (options, _) in COMPAT_FLAGS.items():
        c.add_argument(flag, *filter(None, [_SHORT.get(flag)]), help=argparse.SUPPRESS, **options)
    for names, limited in LIMITED_FLAGS.items():
        c.add_argument(*names, help=limited.help, **limited.options)


def _value(args: argparse.Namespace, flag: str) -> Any:
    return getattr(args, flag.removeprefix("--").replace("-", "_"))


def limited_problem(args: argparse.Namespace) -> str | None:
    """The first flag at a value ferry cannot honour, as one line; None when all can be had."""
    try:
        structured_backend(args)
    except ValueError as e:
        return str(e)
    for names, limited in LIMITED_FLAGS.items():
        value = _value(args, names[0])
        if value is not None and not limited.honoured(value):
            shown = "" if value is True else f" {value}"
            return f"{names[0]}{shown}: {limited.refusal}"
    return None


def compat_notes(args: argparse.Namespace) -> list[str]:
    """One line per compatibility flag given: the flag and what ferry does instead."""
    notes = []
    for flag, (_, note) in COMPAT_FLAGS.items():
        value = _value(args, flag)
        # --no-enable-chunked-prefill asks for something too (that cannot be had); by identity, since
        # a value of 0 (--mm-processor-cache-gb 0) is given as well.
        given = value is not None and (value is not False or flag == "--enable-chunked-prefill")
        if given:
            notes.append(f"{flag} is accepted for vLLM compatibility and changes nothing: {note}")
    for names, limited in LIMITED_FLAGS.items():
        if limited.note and _value(args, names[0]) is not None:
            notes.append(f"{names[0]} {_value(args, names[0])} is what ferry does: {limited.note}")
    return notes + structured_notes(args) + tracing_notes(args)


# Structured outputs are xgrammar's. Other vLLM backends' names start the server (the request fields
# are the same; only a grammar in another backend's syntax, such as guidance's Lark, is a 400 there),
# since refusing a vLLM command line over an implementation choice would surprise more than a note.
STRUCTURED_BACKENDS = ("auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer")


def add_structured_output_args(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--structured-outputs-config",
        default=None,
        metavar="JSON",
        help='vLLM\'s structured-output settings, e.g. \'{"backend": "xgrammar"}\': xgrammar serves every '
        "backend named (" + ", ".join(STRUCTURED_BACKENDS) + "); other keys are noted and ignored",
    )
    p.add_argument(
        "--guided-decoding-backend",
        default=None,
        metavar="NAME[:OPTIONS]",
        help="vLLM's older spelling of the structured-output backend (xgrammar serves it; options are "
        "noted and ignored)",
    )


def structured_backend(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """The backend the flags name (None: none named) and the settings given besides it; ValueError
    for a value that does not parse or a backend vLLM does not have."""
    backend, others = args.guided_decoding_backend, []
    if backend is not None and ":" in backend:  # vLLM's older "xgrammar:disable-any-whitespace" form
        backend, _, options = backend.partition(":")
        others = options.split(",")
    if args.structured_outputs_config is not None:
        try:
            config = json.loads(args.structured_outputs_config)
        except ValueError:
            config = None
        if not isinstance(config, dict):
            raise ValueError(
                '--structured-outputs-config must be a JSON object such as \'{"backend": "xgrammar"}\', '
                f"got {args.structured_outputs_config!r}"
            )
        backend = config.pop("backend", backend)
        others += sorted(config)
    if backend is not None and backend not in STRUCTURED_BACKENDS:
        raise ValueError(
            f"structured-output backend {backend!r} is not one of vLLM's ({', '.join(STRUCTURED_BACKENDS)})"
        )
    return backend, others


def structured_notes(args: argparse.Namespace) -> list[str]:
    backend, others = structured_backend(args)
    notes = []
    if backend is not None:
        notes.append(
            f"structured-output backend {backend}: ferry's structured outputs are xgrammar's (JSON schema, "
            "regex, choice and EBNF grammars)"
        )
    if others:
        notes.append(
            f"structured-output options {', '.join(others)}: accepted for vLLM compatibility, ignored"
        )
    return notes
