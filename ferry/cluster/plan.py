"""From a ``ClusterConfig`` to the exact processes `ferry up` runs: names, ports, argv, environment.

Building a plan starts nothing: `ferry up --dry-run` prints it, the supervisor runs it. Ports the
file leaves open are chosen here, distinct from each other and from the file's own, so a child
keeps its port across restarts and the router's pool URLs stay valid.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import socket
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from ferry.cluster.spec import ClusterConfig, PoolSpec
from kvcache.tier import redact_url

LOOPBACK = "127.0.0.1"
SECRET_FLAGS = frozenset({"--api-key", "--replica-api-key"})


@dataclass(frozen=True)
class ProcessSpec:
    """One child: ``kind`` is ``redis``, ``worker`` or ``router``; ``env`` is added to ours; ``host``
    is where this machine reaches it (the router may listen elsewhere than loopback)."""

    name: str
    kind: str
    argv: tuple[str, ...]
    port: int
    env: Mapping[str, str] = field(default_factory=dict)
    host: str = LOOPBACK

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        if self.kind == "redis":
            return f"redis://{host}:{self.port}/0"
        return f"http://{host}:{self.port}"

    def shell(self) -> str:
        """The command as one line a user can paste into a shell."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        cmd = shlex.join(self.argv)
        return f"{env} {cmd}" if env else cmd

    def redacted_argv(self) -> tuple[str, ...]:
        """``argv`` with secrets (API keys, URL passwords) masked, for logs and the state file."""
        out = [redact_url(arg) for arg in self.argv]
        for i, arg in enumerate(out):
            if arg in SECRET_FLAGS and i + 1 < len(out):
                out[i + 1] = "***"
            elif arg.split("=", 1)[0] in SECRET_FLAGS and "=" in arg:
                out[i] = arg.split("=", 1)[0] + "=***"
        return tuple(out)


@dataclass(frozen=True)
class ClusterPlan:
    kv_tier_url: str | None
    redis: ProcessSpec | None
    workers: tuple[ProcessSpec, ...]
    router: ProcessSpec
    endpoint: str  # where a client on this machine reaches the router

    @property
    def processes(self) -> tuple[ProcessSpec, ...]:
        head = (self.redis,) if self.redis is not None else ()
        return (*head, *self.workers, self.router)


@contextlib.contextmanager
def free_ports() -> Iterator[Callable[[], int]]:
    """Yield a function returning a free loopback port, distinct from every one it gave before.

    Each port stays bound until the block ends so the kernel cannot hand it out twice.
    """
    held: list[socket.socket] = []

    def take() -> int:
        s = socket.socket()
        s.bind((LOOPBACK, 0))
        held.append(s)
        return s.getsockname()[1]

    try:
        yield take
    finally:
        for s in held:
            s.close()


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def pool_threads(config: ClusterConfig, pool: PoolSpec, cpus: int) -> int:
    """A pool's threads per worker: as configured, else an even share of this machine's cores."""
    if pool.threads is not None:
        return pool.threads
    return max(1, cpus // max(1, config.num_workers))


def build_plan(
    config: ClusterConfig,
    python: str = sys.executable,
    cpus: int | None = None,
    port_source: Callable[[], int] | None = None,
    otlp_traces_endpoint: str | None = None,
) -> ClusterPlan:
    """Resolve ports, threads and flags. ``port_source`` gives free ports (tests pin it);
    ``otlp_traces_endpoint`` (`ferry up --otlp-traces-endpoint`): every worker and the router
    export their spans there, each named by ``OTEL_SERVICE_NAME`` (``tracing_env``)."""
    cpus = available_cpus() if cpus is None else cpus
    reserved = {config.router.port}
    if config.kv_tier.redis is not None and config.kv_tier.redis.port is not None:
        reserved.add(config.kv_tier.redis.port)
    for pool in config.pools:
        if pool.port is not None:
            reserved.update(range(pool.port, pool.port + pool.replicas))

    with free_ports() as take:
        source = port_source or take

        def next_port() -> int:
            while True:
                port = source()
                if port not in reserved:
                    reserved.add(port)
                    return port

        redis = None
        kv_tier_url = config.kv_tier.url
        if config.kv_tier.redis is not None:
            spec = config.kv_tier.redis
            port = spec.port if spec.port is not None else next_port()
            argv = (
                spec.binary,
                "--port", str(port),
                "--bind", LOOPBACK,
                # A cache: every block can be recomputed, so nothing is ever written to disk.
                "--save", "",
                "--appendonly", "no",
                "--protected-mode", "no",
                "--maxmemory", spec.maxmemory,
                "--maxmemory-policy", spec.maxmemory_policy,
                *spec.args,
            )  # fmt: skip
            redis = ProcessSpec("redis", "redis", argv, port)
            kv_tier_url = redis.url

        shared_env = {"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **config.env}
        ferry = (python, "-m", "ferry")
        redis_tier = bool(kv_tier_url) and kv_tier_url.startswith(("redis://", "rediss://"))
        workers: list[ProcessSpec] = []
        for pool in config.pools:
            threads = str(pool_threads(config, pool, cpus))
            for i in range(pool.replicas):
                port = pool.port + i if pool.port is not None else next_port()
                argv = [*ferry, "serve", "--host", LOOPBACK, "--port", str(port), "--role", pool.role,
                        "--num-threads", threads, "--drain-timeout", _num(config.drain_timeout)]  # fmt: skip
                if config.model is not None:
                    argv += ["--model", config.model]
                if config.served_model_name is not None:
                    argv += ["--served-model-name", config.served_model_name]
                if kv_tier_url:
                    argv += ["--kv-tier", kv_tier_url]
                if redis_tier and config.router.policy == "cache_aware":
                    # The router follows block events for exact cache-aware routing.
                    argv.append("--kv-events")
                if redis_tier:  # /v1/responses chains continue on any worker, restarted ones too
                    argv += ["--responses-store", kv_tier_url]
                if otlp_traces_endpoint is not None:
                    argv += ["--otlp-traces-endpoint", otlp_traces_endpoint]
                argv += pool.args  # last, so a user's flag wins over ours
                traced = tracing_env(otlp_traces_endpoint, f"ferry-{pool.role}")
                env = {
                    **traced,
                    **shared_env,
                    "OMP_NUM_THREADS": threads,
                    "MKL_NUM_THREADS": threads,
                    **pool.env,
                }
                workers.append(ProcessSpec(f"{pool.role}-{i}", "worker", tuple(argv), port, env))

        r = config.router
        argv = [*ferry, "router", "--host", r.host, "--port", str(r.port), "--policy", r.policy]
        argv += ["--drain-timeout", _num(config.drain_timeout)]  # the router drains as its workers do
        flag = {"mixed": "--replica", "prefill": "--prefill", "decode": "--decode"}
        for w in workers:
            argv += [flag[w.name.rsplit("-", 1)[0]], w.url]
        if redis_tier:
            argv += ["--kv-tier", kv_tier_url]
        tokenizer_dir = router_tokenizer_dir(config)
        if tokenizer_dir is not None:
            # Tokenizer + chat template only: exact block hashes (cache_aware) and prompt lengths (PD).
            argv += ["--model", tokenizer_dir]
            argv += chat_template_args(config)
        if config.block_size is not None and _flag_value(r.args, "--block-size") is None:
            argv += ["--block-size", str(config.block_size)]  # keys blocks as the workers do
        if otlp_traces_endpoint is not None:
            argv += ["--otlp-traces-endpoint", otlp_traces_endpoint]
        argv += r.args
        # A router on one address (``::1``, a LAN address) answers only there: probe it there too.
        host = LOOPBACK if r.host in ("0.0.0.0", "::", "") else r.host
        router_env = {**tracing_env(otlp_traces_endpoint, "ferry-router"), **shared_env}
        router = ProcessSpec("router", "router", tuple(argv), r.port, router_env, host)

    return ClusterPlan(kv_tier_url, redis, tuple(workers), router, router.url)


def tracing_env(endpoint: str | None, service: str) -> dict[str, str]:
    """A traced child's ``OTEL_SERVICE_NAME`` (``ferry-router``, ``ferry-prefill`` …), so a trace
    says which component each span is from; the file's ``env`` (or a pool's) may name another."""
    return {} if endpoint is None else {"OTEL_SERVICE_NAME": service}


CHAT_TEMPLATE_FLAGS = ("--chat-template", "--chat-template-content-format", "--default-chat-template-kwargs")
CHAT_TEMPLATE_SWITCHES = ("--exclude-tools-when-tool-choice-none",)


def chat_template_args(config: ClusterConfig) -> list[str]:
    """The workers' chat-template flags (from the pools' ``args``), for the router to render chats
    as they do; none the router's own ``args`` already set."""
    out: list[str] = []
    for flag in CHAT_TEMPLATE_FLAGS + CHAT_TEMPLATE_SWITCHES:
        if any(a == flag or a.startswith(flag + "=") for a in config.router.args):
            continue
        if flag in CHAT_TEMPLATE_SWITCHES:
            if any(flag in pool.args for pool in config.pools):
                out.append(flag)
            continue
        for pool in config.pools:
            value = _flag_value(pool.args, flag)
            if value is not None:
                out += [flag, value]
                break
    return out


def _flag_value(args: tuple[str, ...] | list[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg[len(flag) + 1 :]
    return None


def router_tokenizer_dir(config: ClusterConfig) -> str | None:
    """The model directory the router reads its tokenizer from: a pool's ``--tokenizer`` if its args
    set one (a local directory), the file's model if it is a local directory, the built-in demo model's path when the file names none (``ferry up`` builds it before
    starting anything), else None (a hub id: the router falls back to text-based keys)."""
    for pool in config.pools:  # the workers read theirs from another directory (--tokenizer)
        tokenizer = _flag_value(pool.args, "--tokenizer")
        if tokenizer is not None:
            return tokenizer if os.path.isdir(tokenizer) else None
    if config.model is None:
        from engine.demo import demo_model_path  # torch-free; nothing is built here

        return str(demo_model_path())
    return config.model if os.path.isdir(config.model) else None


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)
