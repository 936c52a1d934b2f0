"""Replica discovery: where the router learns which replicas exist, behind one interface.

A ``Discovery`` backend answers one question, "which replicas exist right now?", and the
router polls it (about once a second) and reconciles its pools with the answer: new URLs
are added (and probed before they get traffic), URLs that vanished are drained and removed —
at once for a source of truth (Kubernetes, DNS); for heartbeat registrations (Redis) only when
the replica deregistered, or its key stopped while the others' are refreshed, or its own health
probes fail too (``Listing``, ``router/discovery_sync.py``). Backends are chosen by URL scheme
through ``DISCOVERY_BACKENDS``:

* ``redis://`` / ``rediss://`` — replicas started with ``ferry serve --register`` heartbeat a key
  (``router/discovery_redis.py``; the wire format is documented there).
* ``k8s:`` — Kubernetes endpoints (``router/discovery_k8s.py``).
* ``dns:`` — DNS A/AAAA records of a name, port in the URL (``router/discovery_dns.py``).

Backends are imported lazily so the router loads only the client library it uses. This module
must stay free of heavy imports (no torch, no kubernetes, no redis).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from urllib.parse import urlsplit

ROLES = ("mixed", "prefill", "decode")


@dataclass(frozen=True)
class DiscoveredReplica:
    """One replica as a discovery backend sees it."""

    url: str  # base URL, e.g. "http://10.0.0.7:8000" (no trailing slash, no /v1)
    role: str = "mixed"  # mixed | prefill | decode
    model: str | None = None  # served model name, when the backend knows it

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"replica role must be one of {', '.join(ROLES)}, got {self.role!r}")
        object.__setattr__(self, "url", normalize_url(self.url))


@dataclass(frozen=True)
class Listing:
    """One poll of a backend: the replicas it lists, and what a replica missing from them means."""

    replicas: list[DiscoveredReplica]
    # A source of truth (Kubernetes, DNS): a replica it no longer lists is gone. Heartbeat
    # registrations (Redis) are not one: a restarted, full or hung Redis loses the keys of replicas
    # that still serve, so a missing replica is gone only when it ``departed``, or its key stayed
    # away ``grace_s`` while registrations kept ``refreshing``, or its health probes fail too.
    authoritative: bool = True
    departed: frozenset[str] = frozenset()  # replicas that deregistered themselves (clean shutdown)
    refreshing: bool = True  # the source keeps registrations now: a key that stops is its replica's doing
    grace_s: float = 0.0  # how long a missing registration may take to come back (a heartbeat interval)


class Discovery(ABC):
    """Lists the replicas that exist now. Called periodically; must not block the event loop."""

    @abstractmethod
    async def list_replicas(self) -> list[DiscoveredReplica]:
        """Every replica currently known to the backend. Raise on backend errors (the router keeps
        its previous view and retries; a transient outage must not remove every replica)."""

    async def poll(self) -> Listing:
        """``list_replicas`` with what a missing replica means; a backend whose listing is not the
        source of truth overrides it. Raises as ``list_replicas`` does."""
        return Listing(await self.list_replicas())

    async def close(self) -> None:  # noqa: B027 - optional hook, most backends hold nothing
        """Release connections; called once when the router stops."""


# scheme prefix -> "module:Class"; the class is built with the full discovery URL as its only argument.
DISCOVERY_BACKENDS: dict[str, str] = {
    "redis://": "router.discovery_redis:RedisDiscovery",
    "rediss://": "router.discovery_redis:RedisDiscovery",
    "k8s:": "router.discovery_k8s:K8sDiscovery",
    "dns:": "router.discovery_dns:DnsDiscovery",
}


def make_discovery(url: str) -> Discovery:
    """Build the backend for ``url`` (e.g. ``redis://127.0.0.1:6379/0``, ``k8s:ns/svc``, ``dns:host:port``)."""
    for prefix, target in DISCOVERY_BACKENDS.items():
        if url.startswith(prefix):
            module_name, class_name = target.split(":")
            cls = getattr(importlib.import_module(module_name), class_name)
            return cls(url)
    known = ", ".join(DISCOVERY_BACKENDS)
    raise ValueError(f"unknown discovery URL {url!r}: expected one of the schemes {known}")


def check_replica_url(url: str) -> None:
    """Refuse a (normalized) replica URL the relay cannot reach: ``http(s)://host[:port]`` only (the
    upstream client speaks HTTP/1.1, over TLS for https, and sends every request to the root of its
    origin)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError when out of range or not a number
    except ValueError as e:
        raise ValueError(f"replica URL {url!r} is not valid: {e}") from None
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or parts.path
        or parts.query
        or parts.fragment
    ):
        raise ValueError(f"replica URL {url!r} is not valid: http(s)://host[:port] expected")


def normalize_url(url: str) -> str:
    """Canonical replica base URL: scheme added if missing, no trailing slash, no /v1 suffix."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url
