"""`ferry serve` flags (DESIGN.md names). Engine flags map 1:1 onto EngineConfig fields."""

from __future__ import annotations

import argparse


def add_serve_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--model", default=None, help="HF model directory (default: the built-in demo model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--role", choices=["mixed", "prefill", "decode"], default="mixed")
    p.add_argument("--kv-tier", default=None, help="memory://… | redis://host:port/db | rediss://…")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--register", default=None, help="redis://… to announce this replica to routers")
    return p
