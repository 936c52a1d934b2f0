"""The one `ferry` command: `serve`, `run-batch`, `router`, `up`, `bench`.

Each part owns its flags (``server/args.py``, ``router/args.py``, ``bench/args.py``,
``ferry/up.py``); this module only assembles them and dispatches. It imports nothing heavy
at module level so `ferry router` never loads torch.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence

from ferry import __version__


def build_parser() -> argparse.ArgumentParser:
    from bench.args import add_bench_args
    from ferry.up import add_up_args
    from router.args import add_router_args
    from server.args import add_serve_args
    from server.run_batch import add_run_batch_args

    parser = argparse.ArgumentParser(prog="ferry", description="OpenAI-compatible LLM serving.")
    parser.add_argument("--version", action="version", version=f"ferry {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_args(sub.add_parser("serve", help="serve one model replica (OpenAI API)"))
    add_run_batch_args(
        sub.add_parser("run-batch", help="run a JSONL file of OpenAI requests offline (as vllm run-batch)")
    )
    add_router_args(sub.add_parser("router", help="route OpenAI traffic over many replicas"))
    add_up_args(sub.add_parser("up", help="run a whole local cluster from one YAML file"))
    add_bench_args(sub.add_parser("bench", help="benchmark any OpenAI-compatible endpoint"))
    return parser


# SageMaker runs a container as ``<image> serve`` and configures it through environment variables:
# each SM_FERRY_<FLAG> becomes a `ferry serve` flag, as vLLM's image maps SM_VLLM_<FLAG>.
SAGEMAKER_PREFIX = "SM_FERRY_"
SAGEMAKER_DEFAULTS = ("--host", "0.0.0.0", "--port", "8080")  # where SageMaker sends /ping, /invocations


def sagemaker_args(environ: Mapping[str, str]) -> list[str]:
    """The `ferry serve` flags of the SM_FERRY_ variables, in name order: ``SM_FERRY_MAX_MODEL_LEN=4096``
    is ``--max-model-len 4096``; for a switch an empty value or ``true`` is the switch alone
    (``SM_FERRY_ENABLE_LORA=true``: ``--enable-lora``) and ``false`` its ``--no-`` form (nothing, for a
    switch that has none), as in a ``--config`` file. With any of them set, the server listens on
    0.0.0.0:8080 (SageMaker's port) unless they say otherwise. ValueError naming the variable for a
    switch given another value."""
    from server.args import add_serve_args

    options = add_serve_args(argparse.ArgumentParser(add_help=False))._option_string_actions  # noqa: SLF001
    flags: list[str] = []
    for key in sorted(
        k for k in environ if k.startswith(SAGEMAKER_PREFIX) and len(k) > len(SAGEMAKER_PREFIX)
    ):
        flag = "--" + key[len(SAGEMAKER_PREFIX) :].lower().replace("_", "-")
        value = environ[key]
        word = value.strip().lower()
        action = options.get(flag)
        if action is not None and action.nargs == 0:  # a switch: never followed by a value
            if word in ("", "true"):
                flags.append(flag)
            elif word == "false":
                negative = "--no-" + flag[2:]
                flags += [negative] if options.get(negative) is action else []
            else:
                raise ValueError(f"{key}={value!r}: {flag} is a switch, give it true or false")
            continue
        if action is not None:  # a flag that takes a value takes ``true`` as one
            flags += [flag, value] if value else [flag]
        else:  # not a serve flag: the parser names it
            flags += [flag] if word in ("", "true") else [flag, value]
    return [*SAGEMAKER_DEFAULTS, *flags] if flags else []


def _with_config_file(argv: list[str]) -> list[str]:
    """``ferry serve|run-batch … --config FILE``: the file's flags first (ferry/config_file.py)."""
    from ferry.config_file import ConfigFileError, expand_config
    from server.args import add_serve_args
    from server.run_batch import add_run_batch_args

    command = argv[0]
    try:
        return [
            command,
            *expand_config(command, argv[1:], add_serve_args if command == "serve" else add_run_batch_args),
        ]
    except ConfigFileError as e:
        sys.stderr.write(f"{e}\n")
        raise SystemExit(2) from None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:  # flags given on the command line come last, so they win
        try:
            argv = ["serve", *sagemaker_args(os.environ), *argv[1:]]
        except ValueError as e:
            sys.stderr.write(f"ferry serve: error: {e}\n")
            return 2
    if argv[:1] in (["serve"], ["run-batch"]):
        argv = _with_config_file(argv)
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        from server.main import run_serve

        return run_serve(args)
    if args.command == "run-batch":
        from server.run_batch import run_batch

        return run_batch(args)
    if args.command == "router":
        from router.main import run_router

        return run_router(args)
    if args.command == "up":
        from ferry.up import run_up

        return run_up(args)
    if args.command == "bench":
        from bench.main import run_bench

        return run_bench(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
