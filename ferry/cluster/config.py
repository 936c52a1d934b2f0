"""The `ferry up` cluster file: YAML in, a checked ``ClusterConfig`` (``spec.py``) out, with errors
that name the key (``router.port: must be a port number 1-65535, got 70000``).

``parse_config`` trusts nothing in the mapping it gets: every key is known, every value has its
type and range, ports never clash, and the router has somewhere to send requests. Everything after
it trusts the ``ClusterConfig``. Here: the cluster's topology (model, KV tier, router, pools) and
the checks across it; the keys on timeouts, restarts and liveness are read by ``lifecycle_config.py``,
every value by the readers of ``readers.py``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from ferry.cluster.lifecycle_config import LIFECYCLE_READERS
from ferry.cluster.readers import (
    Reader,
    read_args,
    read_count,
    read_env,
    read_mapping,
    read_optional_port,
    read_port,
    read_scalar_text,
    read_str,
    read_threads,
    type_name,
    unknown_key,
)
from ferry.cluster.spec import (
    ROLES,
    ClusterConfig,
    ConfigError,
    KVTierSpec,
    LivenessSpec,
    PoolSpec,
    RedisSpec,
    RestartSpec,
    RouterSpec,
)
from ferry.strict_yaml import load_yaml, not_yaml_problem

__all__ = [
    "ClusterConfig",
    "ConfigError",
    "KVTierSpec",
    "LivenessSpec",
    "PoolSpec",
    "RedisSpec",
    "RestartSpec",
    "RouterSpec",
    "load_config",
    "parse_config",
]

KV_SCHEMES = ("redis://", "rediss://", "memory://")

# Flags `ferry up` sets itself; a pool's or the router's `args` must not set them again.
SERVE_MANAGED = {
    "--host": "workers listen on 127.0.0.1 behind the router; router.host is the front door",
    "--port": "use {pool}.port",
    "--role": "the pool is the role",
    "--model": "use model",
    "--kv-tier": "use kv_tier",
    "--num-threads": "use {pool}.threads",
    "--served-model-name": "use served_model_name",
    "--uds": "workers listen on {pool}.port, where the router reaches them",
}
ROUTER_MANAGED = {
    "--host": "use router.host",
    "--port": "use router.port",
    "--policy": "use router.policy",
    "--replica": "ferry up passes its mixed pool",
    "--prefill": "ferry up passes its prefill pool",
    "--decode": "ferry up passes its decode pool",
    "--kv-tier": "use kv_tier",
    # On a Unix socket the router would not answer on router.port, where ferry up waits for it.
    "--uds": "use router.host and router.port",
}


def _managed_flags(args: tuple[str, ...], path: str, managed: Mapping[str, str], pool: str) -> None:
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag in managed:
            hint = managed[flag].format(pool=pool)
            raise ConfigError(f"{path}: {flag} is set by ferry up ({hint})")


# ---- sections -----------------------------------------------------------------------------------


def _redis(value: Any, path: str) -> RedisSpec:
    if value is None:
        return RedisSpec()
    fields_ = read_mapping(
        value,
        path,
        {
            "port": read_optional_port,
            "maxmemory": read_scalar_text,
            "maxmemory_policy": read_str,
            "binary": read_str,
            "args": read_args,
        },
    )
    return RedisSpec(**fields_)


def _kv_tier(value: Any, path: str) -> KVTierSpec:
    if isinstance(value, str):
        if not value.startswith(KV_SCHEMES):
            raise ConfigError(
                f"{path}: expected a URL redis://…, rediss://… or memory://, or a mapping"
                f" {{redis: {{port: …}}}}, got {value!r}"
            )
        return KVTierSpec(url=value)
    if value is None:
        raise ConfigError(f"{path}: expected a URL or {{redis: {{…}}}}, got null")
    fields_ = read_mapping(value, path, {"redis": _redis})
    if "redis" not in fields_:
        raise ConfigError(f"{path}: expected a URL or {{redis: {{…}}}}, got an empty mapping")
    return KVTierSpec(redis=fields_["redis"])


def _router(value: Any, path: str) -> RouterSpec:
    from router.policies.registry import POLICY_NAMES

    def policy(v: Any, p: str) -> str:
        name = read_str(v, p)
        if name not in POLICY_NAMES:
            raise ConfigError(f"{p}: unknown policy {name!r} (expected one of: {', '.join(POLICY_NAMES)})")
        return name

    fields_ = read_mapping(
        {} if value is None else value,
        path,
        {"host": read_str, "port": read_port, "policy": policy, "args": read_args},
    )
    spec = RouterSpec(**fields_)
    _managed_flags(spec.args, f"{path}.args", ROUTER_MANAGED, "router")
    return spec


def _pool(role: str) -> Callable[[Any, str], PoolSpec]:
    def read(value: Any, path: str) -> PoolSpec:
        fields_ = read_mapping(
            {} if value is None else value,
            path,
            {
                "replicas": read_count,
                "threads": read_threads,
                "port": read_optional_port,
                "args": read_args,
                "env": read_env,
            },
        )
        fields_.setdefault("replicas", 1)  # a pool that is named has one replica unless told
        spec = PoolSpec(role=role, **fields_)
        _managed_flags(spec.args, f"{path}.args", SERVE_MANAGED, role)
        return spec

    return read


def _model(base_dir: Path | None) -> Callable[[Any, str], str | None]:
    def read(value: Any, path: str) -> str | None:
        if value is None:
            return None
        text = os.path.expanduser(read_str(value, path))
        looks_like_path = text.startswith(("/", "./", "../"))
        candidate = Path(text) if Path(text).is_absolute() or base_dir is None else base_dir / text
        if candidate.is_dir():
            return str(candidate.resolve())
        if looks_like_path:
            raise ConfigError(f"{path}: no model directory at {candidate}")
        return text  # a hub id, resolved by `ferry serve`

    return read


def parse_config(data: Any, base_dir: Path | None = None) -> ClusterConfig:
    """Build and check a ``ClusterConfig`` from the YAML document ``data``.

    ``base_dir`` is the cluster file's directory: a relative ``model`` path is resolved there.
    A file that names no pool gets the default topology (1 prefill + 1 decode); once it names
    one, the pools it leaves out have no replicas.
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"the top level must be a mapping, got {type_name(data)}")
    readers: dict[str, Reader] = {
        "model": _model(base_dir),
        "served_model_name": lambda v, p: None if v is None else read_str(v, p),
        "kv_tier": _kv_tier,
        "router": _router,
        "prefill": _pool("prefill"),
        "decode": _pool("decode"),
        "mixed": _pool("mixed"),
        "env": read_env,
        **LIFECYCLE_READERS,
    }
    for key in data:
        if key not in readers:
            raise ConfigError(unknown_key(str(key), key, readers))
    values = {key: readers[key](v, key) for key, v in data.items()}
    if any(role in data for role in ROLES):
        for role in ROLES:
            values.setdefault(role, PoolSpec(role))
    config = ClusterConfig(**values)
    _check_topology(config)
    _check_ports(config)
    return dataclasses.replace(config, block_size=_block_size(config))


def _check_topology(config: ClusterConfig) -> None:
    p, d, m = config.prefill.replicas, config.decode.replicas, config.mixed.replicas
    if p + d + m == 0:
        raise ConfigError("no router targets: prefill.replicas, decode.replicas and mixed.replicas are all 0")
    if (p == 0) != (d == 0):
        raise ConfigError(
            f"prefill.replicas is {p} but decode.replicas is {d}: a prefill pool needs a decode pool"
            " and a decode pool a prefill pool"
        )
    if p and not config.kv_tier.shared:
        raise ConfigError(
            "kv_tier: memory:// is private to each process; prefill and decode pools need a shared"
            " tier (redis://… or {redis: {…}})"
        )


def _block_size(config: ClusterConfig) -> int | None:
    """The ``--block-size`` the pools' args set (None: none does). Pools that would run different
    block sizes are refused, as is a router told another: the router keys prompt blocks, and reads
    the workers' KV events, with the one size they all use."""
    from engine.config import EngineConfig

    runs: list[tuple[str, int, bool]] = []  # (pool with workers, its block size, set in its args)
    for pool in config.pools:
        if pool.replicas:
            n = _block_size_arg(pool.args, f"{pool.role}.args")
            runs.append((pool.role, EngineConfig.block_size if n is None else n, n is not None))
    if not runs:
        return None
    first, size, first_given = runs[0]
    for role, n, given in runs[1:]:
        if n != size:
            raise ConfigError(
                f"{role}.args: block size {_size(n, given)} differs from {first}'s {_size(size, first_given)}:"
                " every pool must run the same --block-size (the router hashes prompts with it)"
            )
    routers = _block_size_arg(config.router.args, "router.args")
    if routers is not None and routers != size:
        raise ConfigError(
            f"router.args: --block-size {routers} differs from the workers' {size}"
            " (ferry up passes the workers' to the router)"
        )
    return size if any(given for _, _, given in runs) else None


def _size(n: int, given: bool) -> str:
    return str(n) if given else f"{n} (the default)"


def _block_size_arg(args: tuple[str, ...], path: str) -> int | None:
    """The last ``--block-size`` in ``args`` (argparse's choice), or None."""
    value = None
    for i, arg in enumerate(args):
        if arg == "--block-size" and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith("--block-size="):
            value = arg.split("=", 1)[1]
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{path}: --block-size must be an integer, got {value!r}") from None


def _check_ports(config: ClusterConfig) -> None:
    """Ports given in the file must be distinct (free ports are chosen distinct at start)."""
    used: dict[int, str] = {}

    def claim(port: int | None, owner: str) -> None:
        if port is None:
            return
        if port in used:
            raise ConfigError(f"port clash: {port} is used by {used[port]} and {owner}")
        used[port] = owner

    claim(config.router.port, "router (router.port)")
    if config.kv_tier.redis is not None:
        claim(config.kv_tier.redis.port, "redis (kv_tier.redis.port)")
    for pool in config.pools:
        if pool.port is None:
            continue
        if pool.port + pool.replicas - 1 > 65535:
            raise ConfigError(
                f"{pool.role}.port: {pool.replicas} replicas from port {pool.port} run past 65535"
            )
        for i in range(pool.replicas):
            claim(
                pool.port + i,
                f"{pool.role}-{i} ({pool.role}.port + {i})" if i else f"{pool.role}-0 ({pool.role}.port)",
            )


def load_config(path: str | os.PathLike | None) -> ClusterConfig:
    """Read a cluster file (or the default cluster when ``path`` is None)."""
    if path is None:
        config = ClusterConfig()
        _check_ports(config)
        return config
    path = Path(path)
    problem = not_yaml_problem(path)
    if problem is not None:
        raise ConfigError(f"{problem}; see deploy/local/cluster.yaml")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"cannot read {path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    try:
        data = load_yaml(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"not valid YAML: {_yaml_problem(e)}") from None
    return parse_config(data, path.parent)


def _yaml_problem(e: yaml.YAMLError) -> str:
    """PyYAML's error on one line: ``line 1, column 9: expected ',' or '}', but got '<stream end>'``
    (its own text spans several lines and quotes the file)."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None)
    if mark is None or not problem:
        return " ".join(str(e).split())
    context = getattr(e, "context", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}"
    return f"{where}: {problem}" + (f" ({context})" if context else "")
