"""Replica discovery from DNS (``--discovery dns:…``): every A/AAAA record of a name is a replica.

URL syntax::

    dns:[<role>@]<name>:<port>[,[<role>@]<name>:<port>…][?role=…&scheme=http|https&model=…]

e.g. ``dns:ferry-replica.ferry.svc.cluster.local:8000`` or, for a disaggregated deployment in one
URL, ``dns:prefill@ferry-prefill:8000,decode@ferry-decode:8000``. ``role=`` is the role of entries
that name none (default ``mixed``).

Made for a Kubernetes *headless* Service (``clusterIP: None``): its name resolves to the pod IPs
of its Ready endpoints only, so readiness is already applied by the cluster DNS. This needs no API
access at all (no RBAC); the price is DNS caching, so a pod that stops being Ready leaves the
router's view up to the DNS TTL later (CoreDNS: 5 s by default for cluster names) instead of at once.

A name that does not exist or has no address (``EAI_NONAME``/``EAI_NODATA``: e.g. a headless
Service with no Ready pod) means "no replicas"; any other resolver failure raises, so the router
keeps its previous view through a DNS outage.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from dataclasses import dataclass
from urllib.parse import parse_qs

from router.discovery import ROLES, DiscoveredReplica, Discovery

logger = logging.getLogger(__name__)

# Resolver answers that mean "this name has no address", as opposed to "the resolver failed".
_NO_ADDRESS = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}
_QUERY_KEYS = {"role", "scheme", "model"}


@dataclass(frozen=True)
class DnsName:
    """One name to resolve: all its addresses are replicas of ``role`` on ``port``."""

    host: str
    port: int
    role: str = "mixed"


@dataclass(frozen=True)
class DnsTarget:
    names: tuple[DnsName, ...]
    scheme: str = "http"
    model: str | None = None


def parse_dns_url(url: str) -> DnsTarget:
    """Parse a ``dns:`` discovery URL; raises ``ValueError`` with the expected syntax on bad input."""
    usage = "expected dns:[<role>@]<name>:<port>[,…][?role=…&scheme=…&model=…]"
    if not url.startswith("dns:"):
        raise ValueError(f"not a dns discovery URL: {url!r}; {usage}")
    body, _, query = url[len("dns:") :].partition("?")
    params = {k: v[-1] for k, v in parse_qs(query, keep_blank_values=True).items()}
    unknown = sorted(set(params) - _QUERY_KEYS)
    if unknown:
        raise ValueError(
            f"unknown parameter(s) {', '.join(unknown)} in {url!r}; known: {', '.join(sorted(_QUERY_KEYS))}"
        )
    default_role = params.get("role") or "mixed"
    scheme = params.get("scheme") or "http"
    if scheme not in ("http", "https"):
        raise ValueError(f"scheme must be http or https, got {scheme!r} in {url!r}")
    names = []
    for entry in body.split(","):
        role, at, hostport = entry.rpartition("@")
        role = role if at else default_role
        host, colon, port = hostport.rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"bad entry {entry!r} in {url!r}; {usage}")
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r} in {url!r}")
        names.append(DnsName(host=host.strip("[]"), port=int(port), role=role))
    return DnsTarget(names=tuple(names), scheme=scheme, model=params.get("model") or None)


class DnsDiscovery(Discovery):
    """Resolves each name on every poll (``loop.getaddrinfo``, off the event loop)."""

    def __init__(self, url: str) -> None:
        self.target = parse_dns_url(url)

    async def list_replicas(self) -> list[DiscoveredReplica]:
        found: dict[str, DiscoveredReplica] = {}
        for name in self.target.names:
            for address in await self._resolve(name):
                host = f"[{address}]" if ":" in address else address
                url = f"{self.target.scheme}://{host}:{name.port}"
                found.setdefault(url, DiscoveredReplica(url=url, role=name.role, model=self.target.model))
        return [found[u] for u in sorted(found)]

    async def _resolve(self, name: DnsName) -> list[str]:
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(name.host, name.port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            if exc.errno in _NO_ADDRESS:
                logger.info("dns discovery: %s has no address (%s); no replicas there", name.host, exc)
                return []
            raise
        addresses = {
            info[4][0].split("%")[0] for info in infos if info[0] in (socket.AF_INET, socket.AF_INET6)
        }
        return sorted(addresses, key=lambda a: (ipaddress.ip_address(a).version, ipaddress.ip_address(a)))
