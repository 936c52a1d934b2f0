"""Replica discovery from Kubernetes EndpointSlices (``--discovery k8s:…``).

URL syntax (all query parameters optional)::

    k8s:<namespace>/<service>[,<service>…][?role=…&role-label=…&port=…&scheme=…&model=…&watch=…]
    k8s:<namespace>?selector=<label selector>[&…the same parameters…]

* ``<namespace>`` may be empty (``k8s:/ferry-decode``): the router's own namespace, read from
  ``$POD_NAMESPACE`` or the service-account namespace file.
* ``<service>``: the (headless) Service whose EndpointSlices list the replicas; several services,
  comma-separated, are watched together. With ``selector=`` instead, every EndpointSlice in the
  namespace whose labels match (the EndpointSlice controller copies a Service's labels onto its
  slices) is used — one URL then covers the prefill and the decode pools.
* ``role=mixed|prefill|decode`` fixes the role of every replica found; otherwise the role is the
  value of the slice label ``role-label`` (default ``ferry.dev/role``, set on the Service), and
  ``mixed`` when the label is absent. A slice whose label names an unknown role is skipped.
* ``port=<name|number>``: the replica port; by default the slice's only port, or the one named
  ``http``.
* ``scheme=http|https`` (default ``http``), ``model=<served model name>`` (default: unknown).
* ``watch=true|false`` (default ``true``): keep a local copy current with a list + watch (one
  long-lived API call per router); ``false`` lists on every poll instead.

Only endpoints that are Ready and not terminating are replicas: a pod leaves the router's view the
moment its readiness probe fails or its deletion starts (before its preStop hook runs), which is
what lets a draining replica finish its streams without receiving new ones. A pod listed in two
slices (IPv4 and IPv6 on a dual-stack Service) is one replica, reached over IPv4.

RBAC: ``get``, ``list`` and ``watch`` on ``endpointslices.discovery.k8s.io`` in the namespace
(``deploy/k8s/base/router-rbac.yaml``). The ``kubernetes`` client is imported only when a
discovery is built against a real cluster, so the router imports without it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

from router.discovery import ROLES, DiscoveredReplica, Discovery

logger = logging.getLogger(__name__)

DEFAULT_ROLE_LABEL = "ferry.dev/role"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"  # set by the EndpointSlice controller
SA_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
WATCH_TIMEOUT_S = 300  # the API server ends a watch after this; we resume from the last version
# (connect, read) seconds. A watch's read timeout outlasts its server-side timeout (bookmarks arrive
# about once a minute), so only a dead connection trips it instead of leaving the view stale forever.
LIST_REQUEST_TIMEOUT = (5, 30)
WATCH_REQUEST_TIMEOUT = (5, WATCH_TIMEOUT_S + 30)
RETRY_DELAY_S = 2.0
_ADDRESS_TYPE_ORDER = {"IPv4": 0, "IPv6": 1, "FQDN": 2}
_QUERY_KEYS = {"role", "role-label", "port", "scheme", "model", "watch", "selector"}


@dataclass(frozen=True)
class K8sTarget:
    """What a ``k8s:`` URL asks for."""

    namespace: str
    services: tuple[str, ...] = ()
    selector: str | None = None
    role: str | None = None  # fixed role; None: from role_label
    role_label: str = DEFAULT_ROLE_LABEL
    port: str | None = None  # port name or number; None: the only port, or the one named "http"
    scheme: str = "http"
    model: str | None = None
    watch: bool = True

    @property
    def label_selector(self) -> str:
        parts = []
        if len(self.services) == 1:
            parts.append(f"{SERVICE_NAME_LABEL}={self.services[0]}")
        elif self.services:
            parts.append(f"{SERVICE_NAME_LABEL} in ({','.join(self.services)})")
        if self.selector:
            parts.append(self.selector)
        return ",".join(parts)


def parse_k8s_url(url: str, default_namespace: Callable[[], str] | None = None) -> K8sTarget:
    """Parse a ``k8s:`` discovery URL; raises ``ValueError`` with the expected syntax on bad input."""
    usage = "expected k8s:<namespace>/<service>[?role=…] or k8s:<namespace>?selector=<labels>"
    if not url.startswith("k8s:"):
        raise ValueError(f"not a k8s discovery URL: {url!r}; {usage}")
    rest = url[len("k8s:") :]
    path, _, query = rest.partition("?")
    params = {k: v[-1] for k, v in parse_qs(query, keep_blank_values=True).items()}
    unknown = sorted(set(params) - _QUERY_KEYS)
    if unknown:
        raise ValueError(
            f"unknown parameter(s) {', '.join(unknown)} in {url!r}; known: {', '.join(sorted(_QUERY_KEYS))}"
        )
    namespace, slash, service_part = path.partition("/")
    services = tuple(s for s in service_part.split(",") if s) if slash else ()
    selector = params.get("selector") or None
    if not services and not selector:
        raise ValueError(f"{url!r} names neither a service nor a selector; {usage}")
    role = params.get("role") or None
    if role is not None and role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r} in {url!r}")
    scheme = params.get("scheme") or "http"
    if scheme not in ("http", "https"):
        raise ValueError(f"scheme must be http or https, got {scheme!r} in {url!r}")
    watch = (params.get("watch") or "true").lower()
    if watch not in ("true", "false", "1", "0"):
        raise ValueError(f"watch must be true or false, got {watch!r} in {url!r}")
    if not namespace:
        namespace = (default_namespace or own_namespace)()
    return K8sTarget(
        namespace=namespace,
        services=services,
        selector=selector,
        role=role,
        role_label=params.get("role-label") or DEFAULT_ROLE_LABEL,
        port=params.get("port") or None,
        scheme=scheme,
        model=params.get("model") or None,
        watch=watch in ("true", "1"),
    )


def own_namespace() -> str:
    """The namespace this process runs in: ``$POD_NAMESPACE``, the service-account file, or default."""
    env = os.environ.get("POD_NAMESPACE")
    if env:
        return env
    try:
        with open(SA_NAMESPACE_FILE, encoding="utf-8") as f:
            return f.read().strip() or "default"
    except OSError:
        return "default"


def replicas_from_slices(slices: Iterable[Any], target: K8sTarget) -> list[DiscoveredReplica]:
    """Turn EndpointSlice objects (``V1EndpointSlice``) into the Ready replicas they list, sorted by URL."""
    ordered = sorted(
        slices, key=lambda s: (_ADDRESS_TYPE_ORDER.get(s.address_type, 9), s.metadata.name or "")
    )
    seen: set[str] = set()
    found: dict[str, DiscoveredReplica] = {}
    for slc in ordered:
        role = _slice_role(slc, target)
        port = _slice_port(slc, target)
        if role is None or port is None:
            continue
        for ep in slc.endpoints or []:
            if not _is_ready(ep) or not ep.addresses:
                continue
            pod = _pod_key(ep)
            if pod in seen:
                continue
            seen.add(pod)
            host = ep.addresses[0]  # the API guarantees all addresses of an endpoint are fungible
            if slc.address_type == "IPv6":
                host = f"[{host}]"
            url = f"{target.scheme}://{host}:{port}"
            found[url] = DiscoveredReplica(url=url, role=role, model=target.model)
    return [found[u] for u in sorted(found)]


def _is_ready(ep: Any) -> bool:
    cond = ep.conditions
    if cond is None:
        return True  # the API documents a missing condition as ready
    return cond.ready is not False and cond.terminating is not True


def _pod_key(ep: Any) -> str:
    ref = ep.target_ref
    if ref is not None and (ref.uid or ref.name):
        return ref.uid or f"{ref.namespace}/{ref.name}"
    return ep.addresses[0]


def _slice_role(slc: Any, target: K8sTarget) -> str | None:
    if target.role is not None:
        return target.role
    labels = slc.metadata.labels or {}
    role = labels.get(target.role_label, "mixed")
    if role not in ROLES:
        logger.warning(
            "EndpointSlice %s: label %s=%r is not a role; skipped", slc.metadata.name, target.role_label, role
        )
        return None
    return role


def _slice_port(slc: Any, target: K8sTarget) -> int | None:
    if target.port is not None and target.port.isdigit():
        return int(target.port)
    ports = [p for p in (slc.ports or []) if p.port]
    if target.port is not None:
        named = [p.port for p in ports if p.name == target.port]
    elif len(ports) == 1:
        named = [ports[0].port]
    else:
        named = [p.port for p in ports if p.name == "http"]
    if not named:
        logger.warning(
            "EndpointSlice %s: no port %s; skipped", slc.metadata.name, target.port or "(single or 'http')"
        )
        return None
    return named[0]


class SliceStore:
    """The EndpointSlices currently known, by name; fed by a list and then by watch events."""

    def __init__(self) -> None:
        self._slices: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.resource_version: str | None = None

    def replace(self, slices: Iterable[Any], resource_version: str | None) -> None:
        with self._lock:
            self._slices = {s.metadata.name: s for s in slices}
            self.resource_version = resource_version

    def apply(self, event_type: str, obj: Any) -> None:
        """Apply one watch event (ADDED, MODIFIED, DELETED, BOOKMARK)."""
        if event_type == "BOOKMARK":
            meta = obj.get("metadata", {}) if isinstance(obj, dict) else obj.metadata
            rv = meta.get("resourceVersion") if isinstance(meta, dict) else meta.resource_version
            with self._lock:
                self.resource_version = rv or self.resource_version
            return
        with self._lock:
            if event_type == "DELETED":
                self._slices.pop(obj.metadata.name, None)
            elif event_type in ("ADDED", "MODIFIED"):
                self._slices[obj.metadata.name] = obj
            self.resource_version = obj.metadata.resource_version or self.resource_version

    def snapshot(self) -> list[Any]:
        with self._lock:
            return list(self._slices.values())


class K8sDiscovery(Discovery):
    """Ready replicas behind headless Services, from the Kubernetes API.

    ``api`` (a ``kubernetes.client.DiscoveryV1Api``) and ``watch_factory`` (``kubernetes.watch.Watch``)
    are built from the in-cluster service account (or ``~/.kube/config``) unless given.
    """

    def __init__(self, url: str, *, api: Any = None, watch_factory: Callable[[], Any] | None = None) -> None:
        self.target = parse_k8s_url(url)
        if api is None:
            # Refused at start (``ferry router: error: ...``), not found at every poll after it.
            try:
                import kubernetes  # noqa: F401
            except ImportError:
                raise ValueError(
                    "--discovery k8s: needs the kubernetes client: pip install kubernetes (ferry's 'k8s' extra)"
                ) from None
        self._api = api
        self._watch_factory = watch_factory
        self._store = SliceStore()
        self._listed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._active_watch: Any = None
        self._stale: str | None = None  # why the local copy may be out of date (relist failing)

    async def list_replicas(self) -> list[DiscoveredReplica]:
        if not self.target.watch:
            slices, _ = await asyncio.to_thread(self._list)
            return replicas_from_slices(slices, self.target)
        if not self._listed:
            # The first answer comes from a synchronous list, so the router's first poll is complete;
            # a failure here (RBAC, API down) raises and the router retries on its next poll.
            slices, rv = await asyncio.to_thread(self._list)
            self._store.replace(slices, rv)
            self._listed = True
            self._thread = threading.Thread(target=self._watch_loop, name="ferry-k8s-discovery", daemon=True)
            self._thread.start()
        if self._stale is not None:
            # Raising keeps the router on its previous view and makes the outage visible in its log.
            raise RuntimeError(f"k8s discovery cannot reach the API server: {self._stale}")
        return replicas_from_slices(self._store.snapshot(), self.target)

    async def close(self) -> None:
        self._stop.set()
        watch = self._active_watch
        if watch is not None:
            watch.stop()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5.0)

    def _client(self) -> Any:
        if self._api is None:
            from kubernetes import client, config

            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            self._api = client.DiscoveryV1Api()
        return self._api

    def _list(self) -> tuple[list[Any], str | None]:
        resp = self._client().list_namespaced_endpoint_slice(
            self.target.namespace,
            label_selector=self.target.label_selector,
            _request_timeout=LIST_REQUEST_TIMEOUT,
        )
        return list(resp.items or []), resp.metadata.resource_version if resp.metadata else None

    def _new_watch(self) -> Any:
        if self._watch_factory is None:
            from kubernetes import watch

            self._watch_factory = watch.Watch
        return self._watch_factory()

    def _watch_loop(self) -> None:
        """Keep the store current: watch from the last version; relist when the version expired."""
        while not self._stop.is_set():
            try:
                self._watch_once()
            except Exception as exc:  # noqa: BLE001 - any API failure: wait, relist, go on
                if self._stop.is_set():
                    return
                status = getattr(exc, "status", None)
                if status != 410:
                    logger.warning("k8s discovery watch failed (%s); relisting in %.0fs", exc, RETRY_DELAY_S)
                    self._stop.wait(RETRY_DELAY_S)
                try:
                    slices, rv = self._list()
                    self._store.replace(slices, rv)
                    self._stale = None
                except Exception as list_exc:  # noqa: BLE001
                    self._stale = str(list_exc)
                    logger.warning("k8s discovery relist failed: %s", list_exc)
                    self._stop.wait(RETRY_DELAY_S)

    def _watch_once(self) -> None:
        watch = self._new_watch()
        self._active_watch = watch
        try:
            for event in watch.stream(
                self._client().list_namespaced_endpoint_slice,
                self.target.namespace,
                label_selector=self.target.label_selector,
                resource_version=self._store.resource_version,
                timeout_seconds=WATCH_TIMEOUT_S,
                allow_watch_bookmarks=True,
                _request_timeout=WATCH_REQUEST_TIMEOUT,
            ):
                if self._stop.is_set():
                    return
                obj = event["raw_object"] if event["type"] == "BOOKMARK" else event["object"]
                self._store.apply(event["type"], obj)
        finally:
            self._active_watch = None
