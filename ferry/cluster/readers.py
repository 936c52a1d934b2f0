"""Readers of the cluster file's values: each takes ``(value, key path)`` and returns the typed value
or raises a ``ConfigError`` that names the key and what it got (``router.port: must be a port number
1-65535, got 70000``). Generic: nothing here knows what a key means to the cluster; the sections
that do are in ``config.py`` (topology) and ``lifecycle_config.py`` (timeouts, restarts, liveness).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from ferry.cluster.spec import ConfigError

Reader = Callable[[Any, str], Any]


def type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def read_int(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{path}: expected an integer, got {value!r} ({type_name(value)})")
    return value


def read_number(value: Any, path: str) -> float:
    """A number > 0 (seconds of a timeout or delay)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{path}: expected a number, got {value!r} ({type_name(value)})")
    if math.isnan(value) or value <= 0:  # NaN compares false with everything: a timeout never fires
        raise ConfigError(f"{path}: must be > 0, got {value}")
    return float(value)


def read_str(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{path}: expected a non-empty string, got {value!r} ({type_name(value)})")
    return value


def read_count(value: Any, path: str) -> int:
    n = read_int(value, path)
    if n < 0:
        raise ConfigError(f"{path}: must be >= 0, got {n}")
    return n


def read_threads(value: Any, path: str) -> int | None:
    if value is None:
        return None
    n = read_int(value, path)
    if n < 1:
        raise ConfigError(f"{path}: must be >= 1 (or null for an even share of the cores), got {n}")
    return n


def read_port(value: Any, path: str) -> int:
    n = read_int(value, path)
    if not 1 <= n <= 65535:
        raise ConfigError(f"{path}: must be a port number 1-65535, got {n}")
    return n


def read_optional_port(value: Any, path: str) -> int | None:
    return None if value is None else read_port(value, path)


def read_scalar_text(value: Any, path: str) -> str:
    # YAML reads `8` and `0.5` as numbers; on a command line or in the environment they are text.
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ConfigError(f"{path}: expected a string, got {value!r} ({type_name(value)})")
    return str(value)


def read_args(value: Any, path: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise ConfigError(f"{path}: expected a list of strings, got {value!r} ({type_name(value)})")
    return tuple(read_scalar_text(v, f"{path}[{i}]") for i, v in enumerate(value))


def read_env(value: Any, path: str) -> Mapping[str, str]:
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a mapping NAME: value, got {value!r} ({type_name(value)})")
    out: dict[str, str] = {}
    for name, v in value.items():
        if not isinstance(name, str) or not name or "=" in name:
            raise ConfigError(f"{path}: {name!r} is not an environment variable name")
        out[name] = read_scalar_text(v, f"{path}.{name}")
    return MappingProxyType(out)


def read_mapping(value: Any, path: str, readers: Mapping[str, Reader]) -> dict[str, Any]:
    """Read a mapping whose keys must all be in ``readers``; returns {key: typed value}."""
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a mapping, got {value!r} ({type_name(value)})")
    out: dict[str, Any] = {}
    for key, v in value.items():
        if key not in readers:
            raise ConfigError(unknown_key(f"{path}.{key}", key, readers))
        out[key] = readers[key](v, f"{path}.{key}")
    return out


def unknown_key(path: str, key: Any, known: Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(str(key), list(known), n=1)
    guess = f", did you mean {close[0]}?" if close else ""
    return f"{path}: unknown key{guess} (expected one of: {', '.join(known)})"
