"""`ferry up`: a whole local cluster (router, prefill/decode pools, KV tier) from one YAML file."""

from __future__ import annotations

import argparse


def add_up_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--config", default=None, help="cluster YAML (default: router + 1 prefill + 1 decode + Redis)")
    return p
