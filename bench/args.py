"""`ferry bench` flags."""

from __future__ import annotations

import argparse


def add_bench_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--base-url", required=False, default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None)
    return p
