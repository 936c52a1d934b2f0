"""The `ferry up` cluster as typed, frozen values (what ``config.py`` builds from the YAML file).

The concepts are those of the Kubernetes manifests in ``deploy/k8s`` (one cluster, two runtimes):
``model`` / ``served_model_name`` (``MODEL_PATH`` / ``SERVED_MODEL_NAME`` there), ``kv_tier``
(``KV_TIER``), a router, and the ``prefill`` / ``decode`` / ``mixed`` pools whose size is
``replicas`` as in a Deployment.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

ROLES = ("prefill", "decode", "mixed")


class ConfigError(ValueError):
    """A cluster file that cannot run; the message starts with the key path (``router.port: …``)."""


@dataclass(frozen=True)
class RedisSpec:
    """A redis-server that `ferry up` starts and stops (the KV tier's ``{redis: {...}}`` form)."""

    port: int | None = None  # None: a free port
    maxmemory: str = "768mb"  # as deploy/k8s/components/redis: a cache, evicted when full
    maxmemory_policy: str = "allkeys-lru"
    binary: str = "redis-server"
    args: tuple[str, ...] = ()


@dataclass(frozen=True)
class KVTierSpec:
    """Either ``url`` (an existing tier) or ``redis`` (a child Redis); exactly one is set."""

    url: str | None = None
    redis: RedisSpec | None = None

    @property
    def shared(self) -> bool:
        return self.redis is not None or not (self.url or "").startswith("memory://")


@dataclass(frozen=True)
class RouterSpec:
    host: str = "127.0.0.1"
    port: int = 8080
    policy: str = "cache_aware"
    args: tuple[str, ...] = ()


@dataclass(frozen=True)
class PoolSpec:
    """One pool of `ferry serve --role ROLE` workers on consecutive ports."""

    role: str
    replicas: int = 0
    threads: int | None = None  # None: this machine's cores shared evenly by all workers
    port: int | None = None  # first port (replica i listens on port + i); None: free ports
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True)
class RestartSpec:
    """Exponential back-off for crashed children: initial_delay, doubled per crash, capped."""

    initial_delay: float = 1.0
    max_delay: float = 30.0
    reset_after: float = 60.0  # seconds healthy after which the next crash starts from initial_delay


@dataclass(frozen=True)
class LivenessSpec:
    """Probes of a running worker's or router's ``/health`` (a Kubernetes liveness probe's
    periodSeconds, timeoutSeconds, failureThreshold and terminationGracePeriodSeconds): that many
    probes in a row left unanswered (any HTTP status is an answer, 503 included) and the child is
    killed, to be restarted. ``ClusterConfig.liveness`` is None when the file says ``liveness: false``.
    """

    interval: float = 5.0  # seconds between the end of one probe and the next
    timeout: float = 5.0  # seconds each probe waits to connect and for the answer
    failure_threshold: int = 3
    # Seconds from a hung child's SIGTERM to its SIGKILL (0: SIGKILL at once). Short by default: a
    # child that left failure_threshold probes unanswered is rarely one a drain would save. Given
    # SIGTERM, a child drains for up to drain_timeout, then aborts and exits (`ferry up`'s own stop
    # waits drain_timeout + 10 s for that): a grace up to that lets one that was only slow finish;
    # a longer one only delays the restart of one that ignores SIGTERM.
    termination_grace_period: float = 5.0


@dataclass(frozen=True)
class ClusterConfig:
    model: str | None = None  # None: the built-in demo model
    served_model_name: str | None = None
    kv_tier: KVTierSpec = field(default_factory=lambda: KVTierSpec(redis=RedisSpec()))
    router: RouterSpec = field(default_factory=RouterSpec)
    prefill: PoolSpec = field(default_factory=lambda: PoolSpec("prefill", replicas=1))
    decode: PoolSpec = field(default_factory=lambda: PoolSpec("decode", replicas=1))
    mixed: PoolSpec = field(default_factory=lambda: PoolSpec("mixed", replicas=0))
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    drain_timeout: float = 30.0
    startup_timeout: float = 600.0
    restart: RestartSpec = field(default_factory=RestartSpec)
    liveness: LivenessSpec | None = field(default_factory=LivenessSpec)  # None: never killed as hung
    # The KV block size every worker runs with, when a pool's args set it (None: the engine's
    # default); the router hashes prompt blocks with it. Derived from the pools by ``parse_config``.
    block_size: int | None = None

    @property
    def pools(self) -> tuple[PoolSpec, ...]:
        return (self.prefill, self.decode, self.mixed)

    @property
    def num_workers(self) -> int:
        return sum(p.replicas for p in self.pools)
