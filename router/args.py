"""`ferry router` flags (DESIGN.md names)."""

from __future__ import annotations

import argparse

POLICIES = ["round_robin", "least_load", "power_of_two", "session", "cache_aware"]


def add_router_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--replica", action="append", default=[], help="mixed replica URL (repeatable)")
    p.add_argument("--prefill", action="append", default=[], help="prefill worker URL (repeatable)")
    p.add_argument("--decode", action="append", default=[], help="decode worker URL (repeatable)")
    p.add_argument("--policy", choices=POLICIES, default="cache_aware")
    p.add_argument("--kv-tier", default=None)
    p.add_argument("--discovery", default=None, help="redis://… | k8s:… | dns:…")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--api-key", default=None)
    return p
