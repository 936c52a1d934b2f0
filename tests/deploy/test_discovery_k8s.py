"""Kubernetes discovery: URL syntax, EndpointSlice → replica translation, readiness transitions, and
the list + watch loop, all on the official client's own model objects (``V1EndpointSlice``)."""

from __future__ import annotations

import asyncio
import queue
import subprocess
import sys
import time

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from router import discovery_k8s
from router.discovery import DiscoveredReplica, make_discovery
from router.discovery_k8s import K8sDiscovery, K8sTarget, SliceStore, parse_k8s_url, replicas_from_slices


def endpoint(
    ip: str, pod: str, ready: bool | None = True, terminating: bool | None = False
) -> client.V1Endpoint:
    return client.V1Endpoint(
        addresses=[ip],
        conditions=client.V1EndpointConditions(ready=ready, serving=ready, terminating=terminating),
        target_ref=client.V1ObjectReference(kind="Pod", name=pod, namespace="ferry", uid=f"uid-{pod}"),
    )


def endpoint_slice(
    name: str,
    endpoints: list[client.V1Endpoint],
    *,
    role: str | None = None,
    service: str = "ferry-replica",
    address_type: str = "IPv4",
    ports: list[tuple[str | None, int]] | None = None,
    rv: str = "1",
) -> client.V1EndpointSlice:
    labels = {"kubernetes.io/service-name": service}
    if role is not None:
        labels["ferry.dev/role"] = role
    return client.V1EndpointSlice(
        address_type=address_type,
        metadata=client.V1ObjectMeta(name=name, namespace="ferry", labels=labels, resource_version=rv),
        endpoints=endpoints,
        ports=[
            client.DiscoveryV1EndpointPort(name=n, port=p, protocol="TCP")
            for n, p in (ports or [("http", 8000)])
        ],
    )


def urls(replicas: list[DiscoveredReplica]) -> list[tuple[str, str]]:
    return [(r.url, r.role) for r in replicas]


# ---------------------------------------------------------------- URL syntax


def test_parse_service_url() -> None:
    t = parse_k8s_url("k8s:ferry/ferry-decode?role=decode&port=http&model=tiny")
    assert t == K8sTarget(
        namespace="ferry", services=("ferry-decode",), role="decode", port="http", model="tiny"
    )
    assert t.label_selector == "kubernetes.io/service-name=ferry-decode"
    assert t.watch is True


def test_parse_multi_service_and_selector_urls() -> None:
    t = parse_k8s_url("k8s:ml/ferry-prefill,ferry-decode?watch=false")
    assert t.services == ("ferry-prefill", "ferry-decode")
    assert t.label_selector == "kubernetes.io/service-name in (ferry-prefill,ferry-decode)"
    assert t.watch is False
    t = parse_k8s_url("k8s:ml?selector=app.kubernetes.io/component=replica&role-label=tier")
    assert t.services == () and t.label_selector == "app.kubernetes.io/component=replica"
    assert t.role_label == "tier"


def test_parse_empty_namespace_uses_own_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_k8s_url("k8s:/svc", default_namespace=lambda: "mine").namespace == "mine"
    monkeypatch.setenv("POD_NAMESPACE", "from-env")
    assert parse_k8s_url("k8s:/svc").namespace == "from-env"


@pytest.mark.parametrize(
    "url, message",
    [
        ("k8s:ferry", "neither a service nor a selector"),
        ("k8s:ferry/svc?role=leader", "role must be one of"),
        ("k8s:ferry/svc?scheme=ftp", "scheme must be http or https"),
        ("k8s:ferry/svc?colour=red", "unknown parameter(s) colour"),
        ("k8s:ferry/svc?watch=maybe", "watch must be true or false"),
    ],
)
def test_parse_rejects_bad_urls(url: str, message: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_k8s_url(url)
    assert message in str(err.value)


def test_registry_builds_k8s_backend() -> None:
    disc = make_discovery("k8s:ferry/ferry-replica")
    assert isinstance(disc, K8sDiscovery)
    assert disc.target.services == ("ferry-replica",)


def test_module_imports_without_kubernetes_or_torch() -> None:
    # Without the client, a k8s discovery is refused when the router starts: one line that names it.
    code = (
        "import sys; sys.modules['kubernetes'] = None\n"
        "import router.discovery_k8s, router.discovery_dns\n"
        "from router.discovery import make_discovery\n"
        "make_discovery('dns:localhost:8000')\n"
        "assert 'torch' not in sys.modules\n"
        "from ferry.cli import main\n"
        "sys.exit(main(['router', '--discovery', 'k8s:ns/svc', '--port', '0']))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr == (
        "ferry router: error: --discovery k8s: needs the kubernetes client: pip install kubernetes"
        " (ferry's 'k8s' extra)\n"
    )


# ---------------------------------------------------------------- translation


def test_only_ready_non_terminating_endpoints_are_replicas() -> None:
    slc = endpoint_slice(
        "s1",
        [
            endpoint("10.0.0.1", "a"),
            endpoint("10.0.0.2", "b", ready=False),
            endpoint("10.0.0.3", "c", ready=True, terminating=True),
            endpoint("10.0.0.4", "d", ready=None, terminating=None),  # nil ready means ready (API docs)
        ],
    )
    target = parse_k8s_url("k8s:ferry/ferry-replica")
    assert urls(replicas_from_slices([slc], target)) == [
        ("http://10.0.0.1:8000", "mixed"),
        ("http://10.0.0.4:8000", "mixed"),
    ]


def test_role_from_service_label_and_fixed_role() -> None:
    slices = [
        endpoint_slice("p1", [endpoint("10.0.1.1", "p")], role="prefill", service="ferry-prefill"),
        endpoint_slice("d1", [endpoint("10.0.2.1", "d")], role="decode", service="ferry-decode"),
        endpoint_slice(
            "x1", [endpoint("10.0.3.1", "x")], role="leader", service="odd"
        ),  # unknown role: skipped
        endpoint_slice("m1", [endpoint("10.0.4.1", "m")], service="plain"),  # no label: mixed
    ]
    by_label = replicas_from_slices(slices, parse_k8s_url("k8s:ferry?selector=app=ferry"))
    assert urls(by_label) == [
        ("http://10.0.1.1:8000", "prefill"),
        ("http://10.0.2.1:8000", "decode"),
        ("http://10.0.4.1:8000", "mixed"),
    ]
    fixed = replicas_from_slices(slices[:1], parse_k8s_url("k8s:ferry/ferry-prefill?role=decode&model=m"))
    assert fixed == [DiscoveredReplica(url="http://10.0.1.1:8000", role="decode", model="m")]


def test_port_selection() -> None:
    two_ports = [("metrics", 9100), ("http", 8000)]
    slc = endpoint_slice("s", [endpoint("10.0.0.1", "a")], ports=two_ports)
    assert urls(replicas_from_slices([slc], parse_k8s_url("k8s:f/s"))) == [("http://10.0.0.1:8000", "mixed")]
    assert urls(replicas_from_slices([slc], parse_k8s_url("k8s:f/s?port=metrics"))) == [
        ("http://10.0.0.1:9100", "mixed")
    ]
    assert urls(replicas_from_slices([slc], parse_k8s_url("k8s:f/s?port=7000&scheme=https"))) == [
        ("https://10.0.0.1:7000", "mixed")
    ]
    unnamed = endpoint_slice("u", [endpoint("10.0.0.2", "b")], ports=[(None, 8123)])
    assert urls(replicas_from_slices([unnamed], parse_k8s_url("k8s:f/s"))) == [
        ("http://10.0.0.2:8123", "mixed")
    ]
    ambiguous = endpoint_slice("amb", [endpoint("10.0.0.3", "c")], ports=[("a", 1), ("b", 2)])
    assert replicas_from_slices([ambiguous], parse_k8s_url("k8s:f/s")) == []


def test_dual_stack_pod_is_one_replica_over_ipv4() -> None:
    v6 = endpoint_slice("s-v6", [endpoint("fd00::5", "a"), endpoint("fd00::6", "only6")], address_type="IPv6")
    v4 = endpoint_slice("s-v4", [endpoint("10.0.0.5", "a")])
    assert urls(replicas_from_slices([v6, v4], parse_k8s_url("k8s:f/s"))) == [
        ("http://10.0.0.5:8000", "mixed"),
        ("http://[fd00::6]:8000", "mixed"),
    ]


def test_readiness_transitions_add_and_remove_exactly() -> None:
    target = parse_k8s_url("k8s:ferry/ferry-replica")
    store = SliceStore()
    store.replace([], "1")

    def view() -> list[str]:
        return [r.url for r in replicas_from_slices(store.snapshot(), target)]

    store.apply("ADDED", endpoint_slice("s", [endpoint("10.0.0.1", "a", ready=False)], rv="2"))
    assert view() == []  # starting: not Ready yet
    store.apply("MODIFIED", endpoint_slice("s", [endpoint("10.0.0.1", "a")], rv="3"))
    assert view() == ["http://10.0.0.1:8000"]
    store.apply(
        "MODIFIED", endpoint_slice("s", [endpoint("10.0.0.1", "a"), endpoint("10.0.0.2", "b")], rv="4")
    )
    assert view() == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    store.apply(
        "MODIFIED",
        endpoint_slice("s", [endpoint("10.0.0.1", "a", ready=False), endpoint("10.0.0.2", "b")], rv="5"),
    )
    assert view() == ["http://10.0.0.2:8000"]  # probe failed: out at once
    store.apply(
        "MODIFIED", endpoint_slice("s", [endpoint("10.0.0.2", "b", ready=False, terminating=True)], rv="6")
    )
    assert view() == []  # a (removed from the slice) and b (draining) are both gone
    store.apply("ADDED", endpoint_slice("s2", [endpoint("10.0.0.3", "c")], rv="7"))
    store.apply("BOOKMARK", {"kind": "EndpointSlice", "metadata": {"resourceVersion": "9"}})
    assert store.resource_version == "9"
    assert view() == ["http://10.0.0.3:8000"]
    store.apply("DELETED", endpoint_slice("s2", [endpoint("10.0.0.3", "c")], rv="10"))
    assert view() == []
    assert store.resource_version == "10"


# ---------------------------------------------------------------- the list + watch loop


class FakeDiscoveryApi:
    """Stands in for ``DiscoveryV1Api``: ``list_namespaced_endpoint_slice`` answers the current state."""

    def __init__(self, slices: list[client.V1EndpointSlice], rv: str) -> None:
        self.slices = slices
        self.rv = rv
        self.list_calls: list[tuple[str, str]] = []
        self.fail: Exception | None = None

    def list_namespaced_endpoint_slice(self, namespace: str, **kwargs: object) -> client.V1EndpointSliceList:
        assert "watch" not in kwargs  # a watch goes through FakeWatch.stream, never a plain list
        self.list_calls.append((namespace, str(kwargs.get("label_selector"))))
        assert kwargs["_request_timeout"] == (5, 30)
        if self.fail is not None:
            raise self.fail
        return client.V1EndpointSliceList(
            items=list(self.slices), metadata=client.V1ListMeta(resource_version=self.rv)
        )


class FakeWatch:
    """Stands in for ``kubernetes.watch.Watch``: yields queued events; an exception in the queue is raised."""

    def __init__(self, events: queue.Queue, calls: list[dict]) -> None:
        self.events = events
        self.calls = calls
        self.stopped = False

    def stream(self, func, namespace: str, **kwargs: object):  # noqa: ANN001, ANN201
        self.calls.append({"namespace": namespace, **kwargs})
        while not self.stopped:
            try:
                item = self.events.get(timeout=0.05)
            except queue.Empty:
                continue
            if isinstance(item, BaseException):
                raise item
            yield item

    def stop(self) -> None:
        self.stopped = True


async def wait_for(disc: K8sDiscovery, expected: list[str]) -> None:
    deadline = time.monotonic() + 60  # a hang guard only
    while [r.url for r in await disc.list_replicas()] != expected and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert [r.url for r in await disc.list_replicas()] == expected


async def test_watch_loop_follows_events_and_relists_after_410(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(discovery_k8s, "RETRY_DELAY_S", 0.05)
    api = FakeDiscoveryApi([endpoint_slice("s", [endpoint("10.0.0.1", "a")], rv="5")], rv="7")
    events: queue.Queue = queue.Queue()
    calls: list[dict] = []
    disc = K8sDiscovery(
        "k8s:ferry/ferry-replica?role=decode", api=api, watch_factory=lambda: FakeWatch(events, calls)
    )
    try:
        first = await disc.list_replicas()
        assert first == [DiscoveredReplica(url="http://10.0.0.1:8000", role="decode")]
        assert api.list_calls == [("ferry", "kubernetes.io/service-name=ferry-replica")]

        two = endpoint_slice("s", [endpoint("10.0.0.1", "a"), endpoint("10.0.0.2", "b")], rv="8")
        events.put({"type": "MODIFIED", "object": two, "raw_object": {}})
        await wait_for(disc, ["http://10.0.0.1:8000", "http://10.0.0.2:8000"])
        # The watch resumed from the list's resourceVersion, with the same selector.
        assert calls[0]["resource_version"] == "7"
        assert calls[0]["label_selector"] == "kubernetes.io/service-name=ferry-replica"
        assert calls[0]["allow_watch_bookmarks"] is True
        assert (
            calls[0]["_request_timeout"][1] > calls[0]["timeout_seconds"]
        )  # a dead connection cannot stall it

        # History expired (410 Gone): the loop relists and continues from the new version.
        api.slices = [endpoint_slice("s", [endpoint("10.0.0.9", "z")], rv="40")]
        api.rv = "41"
        events.put(ApiException(status=410, reason="Gone: too old resource version"))
        await wait_for(disc, ["http://10.0.0.9:8000"])
        assert len(api.list_calls) == 2
        events.put({"type": "DELETED", "object": api.slices[0], "raw_object": {}})
        await wait_for(disc, [])
        assert calls[-1]["resource_version"] == "41"

        # The API goes away: the watch fails and so does the relist. The discovery then raises (the
        # router keeps its view and logs the outage) instead of serving a stale copy silently.
        api.fail = ApiException(status=503, reason="Service Unavailable")
        events.put(ApiException(status=500, reason="connection reset"))
        for _ in range(300):
            try:
                await disc.list_replicas()
            except RuntimeError as err:
                assert "cannot reach the API server" in str(err)
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("a failing relist was never reported")
        api.fail = None
        api.slices = [endpoint_slice("s", [endpoint("10.0.0.3", "c")], rv="50")]
        events.put(ApiException(status=500, reason="still resetting"))  # the stale watch fails too
        # Back after the retry delay: the next relist succeeds and the view is current again.
        for _ in range(400):
            try:
                if [r.url for r in await disc.list_replicas()] == ["http://10.0.0.3:8000"]:
                    break
            except RuntimeError:
                pass
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("discovery did not recover after the API came back")
    finally:
        await disc.close()
    assert disc._thread is not None and not disc._thread.is_alive()


async def test_poll_mode_lists_every_time() -> None:
    api = FakeDiscoveryApi([endpoint_slice("s", [endpoint("10.0.0.1", "a")])], rv="3")
    disc = K8sDiscovery("k8s:ferry/ferry-replica?watch=false", api=api)
    assert [r.url for r in await disc.list_replicas()] == ["http://10.0.0.1:8000"]
    api.slices = []
    assert await disc.list_replicas() == []
    assert len(api.list_calls) == 2
    await disc.close()


async def test_first_list_failure_raises_so_router_keeps_its_view() -> None:
    class Forbidden(FakeDiscoveryApi):
        def list_namespaced_endpoint_slice(
            self, namespace: str, **kwargs: object
        ) -> client.V1EndpointSliceList:
            raise ApiException(status=403, reason="Forbidden")

    disc = K8sDiscovery("k8s:ferry/ferry-replica", api=Forbidden([], "0"))
    with pytest.raises(ApiException):
        await disc.list_replicas()
    await disc.close()
