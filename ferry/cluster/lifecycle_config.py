"""The cluster file's keys for how `ferry up` runs its children once they are laid out: how long
it waits for them (``startup_timeout``, ``drain_timeout``), how it restarts the ones that exit
(``restart``) and how it finds and kills the ones that hang (``liveness``): ``LIFECYCLE_READERS``.
``config.py`` reads the file's topology and puts the two together.
"""

from __future__ import annotations

import math
from typing import Any

from ferry.cluster.readers import Reader, read_int, read_mapping, read_number, type_name
from ferry.cluster.spec import ConfigError, LivenessSpec, RestartSpec


def read_restart(value: Any, path: str) -> RestartSpec:
    spec = RestartSpec(
        **read_mapping(
            value, path, {"initial_delay": read_number, "max_delay": read_number, "reset_after": read_number}
        )
    )
    if spec.max_delay < spec.initial_delay:
        raise ConfigError(
            f"{path}.max_delay: must be >= {path}.initial_delay ({spec.max_delay:g} < {spec.initial_delay:g})"
        )
    return spec


def read_liveness(value: Any, path: str) -> LivenessSpec | None:
    """A mapping of probe settings (missing keys at their defaults), ``true`` (all defaults), or
    ``false``: no probes, and no child (our own redis-server included) is ever killed as hung, as a
    Kubernetes container without a livenessProbe. None stands for ``false``."""
    if value is False:
        return None
    if value is True:
        return LivenessSpec()
    if not isinstance(value, dict):
        raise ConfigError(
            f"{path}: expected a mapping {{interval: …, timeout: …, failure_threshold: …,"
            f" termination_grace_period: …}}, or false to switch liveness probes off,"
            f" got {value!r} ({type_name(value)})"
        )
    readers: dict[str, Reader] = {
        "interval": read_number,
        "timeout": read_number,
        "failure_threshold": _failure_threshold,
        "termination_grace_period": _grace,
    }
    return LivenessSpec(**read_mapping(value, path, readers))


def _failure_threshold(value: Any, path: str) -> int:
    n = read_int(value, path)
    if n < 1:
        # A Kubernetes user may reach for 0 to switch the probe off: say how it is done here.
        raise ConfigError(f"{path}: must be >= 1, got {n} (liveness: false switches liveness probes off)")
    return n


def _grace(value: Any, path: str) -> float:
    """Seconds, 0 included (SIGKILL at once); never infinite (a hung child would then stay)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{path}: expected a number of seconds, got {value!r} ({type_name(value)})")
    if not 0 <= value < math.inf:  # NaN compares false with everything
        raise ConfigError(
            f"{path}: must be a finite number of seconds >= 0 (0: SIGKILL at once), got {value}"
        )
    return float(value)


# The top-level keys read here, in the order an unknown key's error lists them.
LIFECYCLE_READERS: dict[str, Reader] = {
    "drain_timeout": read_number,
    "startup_timeout": read_number,
    "restart": read_restart,
    "liveness": read_liveness,
}
