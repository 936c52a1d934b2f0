"""`ferry up`: a whole local cluster (router, prefill/decode pools, KV tier) from one YAML file.

``ferry up [--config cluster.yaml] [--dry-run] [--state-file PATH] [--kv-tier-check-interval S]
[--otlp-traces-endpoint URL]``.
The file's schema is in ``ferry/cluster/config.py`` and ``lifecycle_config.py`` (commented example:
``deploy/local/cluster.yaml``); with no file, the default is a router on port 8080, one prefill and one decode worker of the demo model on free
ports, and a child redis-server as their shared KV tier. Exit status: 0 after a clean stop
(SIGTERM, Ctrl-C, SIGHUP) or a dry run, 1 when the cluster cannot start (an existing KV tier the
file names that does not answer included: workers would start against it and quietly recompute
every block), 2 for a bad cluster file.
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import shutil
import socket
import sys
from pathlib import Path

from ferry.cluster.config import load_config
from ferry.cluster.plan import LOOPBACK, ClusterPlan, build_plan
from ferry.cluster.spec import ClusterConfig, ConfigError
from ferry.cluster.tier_watch import CHECK_INTERVAL_S, CHECK_TIMEOUT_S, is_redis_url, ping_tier
from server.tracing import INSTALL_HINT, tracing_problem

REDIS_MISSING = (
    "{binary} not found on PATH, and the KV tier is a redis-server that ferry up starts"
    " (kv_tier: {{redis: …}}, the default). Install Redis (Debian/Ubuntu: sudo apt-get install"
    " redis-server; Fedora: sudo dnf install redis; macOS: brew install redis), set"
    " kv_tier.redis.binary to its path, or use a Redis you already run (kv_tier: redis://HOST:6379/0)."
)
TIER_UNREACHABLE = (
    "kv_tier: {problem} the KV tier {url}: {reason}. Start that Redis or fix the URL (host, port,"
    " password, TLS), or leave kv_tier out and ferry up starts a redis-server of its own."
)
TIER_TIMEOUT_S = 5.0  # connect and answer timeout of the PING that checks an existing KV tier


def add_up_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument(
        "--config",
        default=None,
        help="cluster YAML (default: router on :8080 + 1 prefill + 1 decode of the demo model + Redis;"
        " see deploy/local/cluster.yaml)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the commands ferry up would run, and exit")
    p.add_argument(
        "--kv-tier-check-interval",
        type=_seconds,
        default=CHECK_INTERVAL_S,
        metavar="SECONDS",
        help="once the cluster is up, PING a Redis KV tier this often (each PING waits at most"
        f" {CHECK_TIMEOUT_S:g} s); a tier that stops answering, or answers again, is said once and"
        f" kept in --state-file (default: {CHECK_INTERVAL_S:g})",
    )
    p.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="every worker and the router export an OpenTelemetry span per request to this OTLP"
        " collector (their own --otlp-traces-endpoint), named by OTEL_SERVICE_NAME ferry-router,"
        f" ferry-prefill, ferry-decode or ferry-mixed; the other OTEL_* variables apply. Needs {INSTALL_HINT}",
    )
    p.add_argument(
        "--state-file",
        default=None,
        help="write the cluster's endpoint and every child's name, pid and URL here (JSON), kept"
        " current across restarts and removed at exit",
    )
    return p


def run_up(args: argparse.Namespace) -> int:
    source = args.config or "default cluster"
    try:
        config = load_config(args.config)
    except ConfigError as e:
        print(f"ferry up: {source}: {e}", file=sys.stderr)
        return 2
    plan = build_plan(config, otlp_traces_endpoint=args.otlp_traces_endpoint)
    if args.dry_run:
        print(format_plan(plan))
        return 0
    state_file = Path(args.state_file) if args.state_file else None
    problem = (
        tracing_problem(args.otlp_traces_endpoint)
        or preflight(config, plan)
        or (state_file_problem(state_file) if state_file else None)
    )
    if problem is not None:
        print(f"ferry up: {problem}", file=sys.stderr)
        return 1

    if config.model is None:
        # Build the demo model once, before the workers (which would race to build it) and the
        # router (which reads its tokenizer) start.
        from engine.demo import demo_model_dir

        try:
            demo_model_dir()
        except KeyboardInterrupt:
            print("ferry up: interrupted while building the demo model; nothing was started", file=sys.stderr)
            return 130

    from ferry.cluster.child import LogSink
    from ferry.cluster.supervisor import Supervisor

    return Supervisor(config, plan, LogSink(sys.stdout), state_file, args.kv_tier_check_interval).run()


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:  # NaN compares false with everything
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def format_plan(plan: ClusterPlan) -> str:
    lines = ["# ferry up --dry-run (ports left open in the file were picked now; a real run picks again)"]
    for spec in plan.processes:
        lines.append(f"# {spec.name}: {spec.url}")
        lines.append(spec.shell())
    lines.append(f"# endpoint: {plan.endpoint}/v1")
    return "\n".join(lines)


def preflight(config: ClusterConfig, plan: ClusterPlan) -> str | None:
    """What would stop the cluster from starting, said before anything starts (None: nothing)."""
    redis = config.kv_tier.redis
    if redis is not None and shutil.which(redis.binary) is None:
        return REDIS_MISSING.format(binary=redis.binary)
    try:
        socket.getaddrinfo(config.router.host, config.router.port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        return f"router.host: cannot listen on {config.router.host!r}: {getattr(e, 'strerror', None) or e}"
    fixed = [("router.port", config.router.host, config.router.port)]
    if redis is not None and redis.port is not None:
        fixed.append(("kv_tier.redis.port", LOOPBACK, redis.port))
    for pool in config.pools:
        if pool.port is not None:
            fixed += [(f"{pool.role}.port", LOOPBACK, pool.port + i) for i in range(pool.replicas)]
    for key, host, port in fixed:
        problem = _bind_problem(host, port)
        if problem is not None:
            return f"{key}: {problem}"
    if config.kv_tier.url is not None:  # an existing tier: last, as it may wait on the network
        return tier_problem(config.kv_tier.url)
    return None


def tier_problem(url: str, timeout_s: float = TIER_TIMEOUT_S) -> str | None:
    """Why the existing KV tier at ``url`` cannot be used (None: it answers PING, or it is not a
    Redis tier). The password, if any, is masked in what is said."""
    from kvcache.tier import open_tier, redact_url

    if not is_redis_url(url):
        return None
    try:
        open_tier(url)  # the workers' own check of its parameters (connects to nothing)
    except ValueError as e:
        return f"kv_tier: {redact_url(str(e))}"
    check = ping_tier(url, timeout_s)
    if check.ok:
        return None
    return TIER_UNREACHABLE.format(problem=check.problem, url=redact_url(url), reason=check.reason)


def state_file_problem(path: Path) -> str | None:
    """Why ``--state-file`` could not be written (None: it can); it is first written once a child
    has started, too late to fail cleanly."""
    parent = path.parent
    if path.is_dir():
        return f"--state-file {path}: is a directory"
    if not parent.is_dir():
        return f"--state-file {path}: no directory {parent}"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"--state-file {path}: cannot write in {parent}"
    return None


def _bind_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on (None: it can)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        # Same option as uvicorn and redis use, so a port in TIME_WAIT does not count as taken.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return f"port {port} is already in use on {host} (another ferry up? choose another port)"
            return f"cannot listen on {host}:{port}: {e.strerror or e}"
    return None
