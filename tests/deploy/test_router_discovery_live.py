"""A real `ferry router` finding a real `ferry serve` through each of its cluster discovery backends.

* ``k8s:`` — the router runs the official ``kubernetes`` client (kubeconfig, list, chunked watch
  stream, model deserialization) against a small Kubernetes API stand-in on loopback that serves
  the EndpointSlice list and watch endpoints. The test flips the replica's endpoint Ready → not
  Ready → Ready → deleted and watches the router's own view (``GET /admin/replicas``) follow.
* ``dns:`` — the router resolves an address literal on every poll.
"""

from __future__ import annotations

import json
import queue
import select
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from deploy_support import MODEL, FerryProcess, free_port, one, parsed_args, selector_matches

NAMESPACE = "ferry"
SERVICE = "ferry-replica"
SLICES_PATH = f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices"


def slice_json(name: str, ip: str, port: int, ready: bool, rv: int, labels: dict[str, str]) -> dict:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "resourceVersion": str(rv),
            "labels": labels,
        },
        "addressType": "IPv4",
        "endpoints": [
            {
                "addresses": [ip],
                "conditions": {"ready": ready, "serving": ready, "terminating": False},
                "targetRef": {
                    "kind": "Pod",
                    "name": f"{name}-pod",
                    "namespace": NAMESPACE,
                    "uid": f"uid-{name}",
                },
            }
        ],
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
    }


class FakeKubeApi:
    """Serves list and watch of EndpointSlices in one namespace, like the API server does: a list
    carries a resourceVersion; a watch is a chunked stream of one JSON event per line; both apply
    the request's labelSelector."""

    def __init__(self) -> None:
        self.slices: dict[str, dict] = {}
        self.rv = 100
        self.requests: list[dict[str, list[str]]] = []
        self.watchers: list[tuple[str, queue.Queue]] = []  # (label selector, events)
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                url = urlsplit(self.path)
                query = parse_qs(url.query)
                api.requests.append({"path": [url.path], **query})
                selector = query.get("labelSelector", [""])[0]
                if url.path != SLICES_PATH:
                    self._send(404, {"kind": "Status", "code": 404, "reason": "NotFound"})
                elif query.get("watch") == ["true"]:
                    self._watch(selector)
                else:
                    with api.lock:
                        body = {
                            "apiVersion": "discovery.k8s.io/v1",
                            "kind": "EndpointSliceList",
                            "metadata": {"resourceVersion": str(api.rv)},
                            "items": [
                                o
                                for o in api.slices.values()
                                if selector_matches(selector, o["metadata"]["labels"])
                            ],
                        }
                    self._send(200, body)

            def _send(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _peer_closed(self) -> bool:
                readable, _, _ = select.select([self.connection], [], [], 0)
                return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""

            def _watch(self, selector: str) -> None:
                events: queue.Queue = queue.Queue()
                with api.lock:
                    api.watchers.append((selector, events))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                try:
                    while not api.stopping.is_set():
                        try:
                            event = events.get(timeout=0.1)
                        except queue.Empty:
                            if self._peer_closed():
                                break
                            continue
                        line = (json.dumps(event) + "\n").encode()
                        self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                except OSError:
                    pass  # the watcher went away
                finally:
                    with api.lock:
                        api.watchers.remove((selector, events))
                    self.close_connection = True

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def put(
        self,
        event_type: str,
        name: str,
        ip: str,
        port: int,
        ready: bool,
        labels: dict[str, str] | None = None,
    ) -> None:
        """Change the state and tell every open watch it concerns, as the EndpointSlice controller would."""
        labels = labels or {"kubernetes.io/service-name": SERVICE, "ferry.dev/role": "mixed"}
        with self.lock:
            self.rv += 1
            obj = slice_json(name, ip, port, ready, self.rv, labels)
            if event_type == "DELETED":
                self.slices.pop(name, None)
            else:
                self.slices[name] = obj
            for selector, events in self.watchers:
                if selector_matches(selector, labels):
                    events.put({"type": event_type, "object": obj})

    def watch_count(self) -> int:
        with self.lock:
            return len(self.watchers)

    def start(self) -> FakeKubeApi:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def kube_api() -> Iterator[FakeKubeApi]:
    api = FakeKubeApi().start()
    yield api
    api.stop()


def kubeconfig(path: Path, server: str) -> Path:
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": server}}],
                "users": [{"name": "router", "user": {"token": "not-checked"}}],
                "contexts": [
                    {"name": "fake", "context": {"cluster": "fake", "user": "router", "namespace": NAMESPACE}}
                ],
                "current-context": "fake",
            }
        )
    )
    return path


def router_view(router: FerryProcess) -> list[tuple[str, str]]:
    replicas = httpx.get(router.url + "/admin/replicas", timeout=5).json()["replicas"]
    return sorted((r["url"], r["role"]) for r in replicas)


def wait_for_view(router: FerryProcess, expected: list[tuple[str, str]], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if router_view(router) == expected:
            return
        time.sleep(0.1)
    assert router_view(router) == expected


def chat(router: FerryProcess) -> httpx.Response:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "temperature": 0,
    }
    return httpx.post(router.url + "/v1/chat/completions", json=body, timeout=60)


def test_router_follows_endpointslices_through_the_kubernetes_client(
    kube_api: FakeKubeApi, replica: FerryProcess, tmp_path: Path, deploy_logs: Path
) -> None:
    kube_api.put("ADDED", "ferry-replica-x1", "127.0.0.1", replica.port, ready=True)
    env = {
        "KUBECONFIG": str(kubeconfig(tmp_path / "kubeconfig", kube_api.url)),
        "KUBERNETES_SERVICE_HOST": "",
    }
    args = [
        "--discovery",
        f"k8s:{NAMESPACE}/{SERVICE}",
        "--discovery-interval",
        "0.2",
        "--policy",
        "round_robin",
    ]
    router = FerryProcess("router", args, deploy_logs, env=env).start(timeout=60)  # healthy = replica found
    try:
        assert router_view(router) == [(replica.url, "mixed")]
        assert chat(router).status_code == 200
        lists = [r for r in kube_api.requests if r.get("watch") != ["true"]]
        watches = [r for r in kube_api.requests if r.get("watch") == ["true"]]
        assert lists[0]["labelSelector"] == [f"kubernetes.io/service-name={SERVICE}"]
        assert watches and watches[0]["labelSelector"] == lists[0]["labelSelector"]
        assert watches[0]["resourceVersion"] == ["101"]  # resumes from the list's version: no gap, no replay

        kube_api.put("MODIFIED", "ferry-replica-x1", "127.0.0.1", replica.port, ready=False)  # probe failed
        wait_for_view(router, [])
        assert chat(router).status_code in (429, 503)  # nothing to route to: a clear refusal, no hang
        kube_api.put("MODIFIED", "ferry-replica-x1", "127.0.0.1", replica.port, ready=True)
        wait_for_view(router, [(replica.url, "mixed")])
        kube_api.put("DELETED", "ferry-replica-x1", "127.0.0.1", replica.port, ready=True)
        wait_for_view(router, [])
    finally:
        router.stop()
    deadline = time.monotonic() + 60
    while kube_api.watch_count() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert kube_api.watch_count() == 0  # the router closed its watch when it stopped


def test_router_finds_replicas_by_dns(replica: FerryProcess, deploy_logs: Path) -> None:
    # Two names, one per role (as a prefill and a decode headless Service would be); the second is
    # listed, health-checked, and never routable (nothing listens on ::1 there).
    url = f"dns:127.0.0.1:{replica.port},decode@[::1]:{replica.port}"
    router = FerryProcess("router", ["--discovery", url, "--discovery-interval", "0.2"], deploy_logs).start(
        timeout=60
    )
    try:
        assert router_view(router) == [(replica.url, "mixed"), (f"http://[::1]:{replica.port}", "decode")]
        assert chat(router).status_code == 200
    finally:
        router.stop()


def test_router_finds_the_pd_pools_with_the_manifests_discovery_url(
    kube_api: FakeKubeApi,
    replica: FerryProcess,
    rendered: dict[str, list[dict]],
    tmp_path: Path,
    deploy_logs: Path,
) -> None:
    """The router runs the very --discovery URL of the rendered disaggregated overlay against slices
    shaped as that overlay's Services produce them: a decode pool (the live replica), a prefill pool,
    and the router's own Service, which carries no role label and must not be picked up."""
    docs = rendered["disaggregated"]
    url = parsed_args(one(docs, "Deployment", "ferry-router"), docs).discovery  # $(POD_NAMESPACE) = ferry
    assert url == f"k8s:{NAMESPACE}?selector=ferry.dev/role"
    prefill_port = free_port()  # nothing listens there: listed by discovery, never healthy
    base = {"app.kubernetes.io/name": "ferry", "app.kubernetes.io/part-of": "ferry"}
    for name, role, port in (
        ("ferry-decode", "decode", replica.port),
        ("ferry-prefill", "prefill", prefill_port),
    ):
        labels = {**base, "app.kubernetes.io/component": "replica", "ferry.dev/role": role,
                  "kubernetes.io/service-name": name}  # fmt: skip
        kube_api.put("ADDED", f"{name}-x1", "127.0.0.1", port, ready=True, labels=labels)
    router_labels = {
        **base,
        "app.kubernetes.io/component": "router",
        "kubernetes.io/service-name": "ferry-router",
    }
    kube_api.put("ADDED", "ferry-router-x1", "127.0.0.2", 8080, ready=True, labels=router_labels)

    env = {
        "KUBECONFIG": str(kubeconfig(tmp_path / "kubeconfig", kube_api.url)),
        "KUBERNETES_SERVICE_HOST": "",
    }
    args = ["--discovery", url, "--discovery-interval", "0.2"]
    router = FerryProcess("router", args, deploy_logs, env=env).start(timeout=60)
    try:
        expected = [(replica.url, "decode"), (f"http://127.0.0.1:{prefill_port}", "prefill")]
        assert router_view(router) == sorted(expected)
        assert chat(router).status_code == 200
    finally:
        router.stop()
