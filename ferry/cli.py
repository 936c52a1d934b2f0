"""The one `ferry` command: `serve`, `router`, `up`, `bench`.

Each part owns its flags (``server/args.py``, ``router/args.py``, ``bench/args.py``,
``ferry/up.py``); this module only assembles them and dispatches. It imports nothing heavy
at module level so `ferry router` never loads torch.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ferry import __version__


def build_parser() -> argparse.ArgumentParser:
    from bench.args import add_bench_args
    from ferry.up import add_up_args
    from router.args import add_router_args
    from server.args import add_serve_args

    parser = argparse.ArgumentParser(prog="ferry", description="OpenAI-compatible LLM serving.")
    parser.add_argument("--version", action="version", version=f"ferry {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_args(sub.add_parser("serve", help="serve one model replica (OpenAI API)"))
    add_router_args(sub.add_parser("router", help="route OpenAI traffic over many replicas"))
    add_up_args(sub.add_parser("up", help="run a whole local cluster from one YAML file"))
    add_bench_args(sub.add_parser("bench", help="benchmark any OpenAI-compatible endpoint"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        from server.main import run_serve

        return run_serve(args)
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
