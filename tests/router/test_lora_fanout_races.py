"""LoRA loads and unloads through `ferry router` (router/lora_admin.py) when a replica misses one or a
restore runs alongside: an unload a replica did not take is sent again at its next good probe and no
request for the adapter goes there meanwhile; a restore and a client's unload of the same adapter
run one after the other, so the replica ends as the client's last operation left it. A replica sits
behind a small relay here that can refuse unloads or hold loads (the interleavings are made, not
hoped for)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from router_harness import Cluster, Proc, metric, replicas_view, wait_until

from engine.demo import build_lora_adapter

LORA_FLAGS = ("--enable-lora", "--allow-runtime-lora-updating")
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


class Relay:
    """Passes every request to ``target``; ``refuse_unloads``: answers unloads 503 itself;
    ``hold_loads``: keeps loads until ``release`` is set. ``seen``: the POST paths it was sent."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.refuse_unloads = False
        self.hold_loads = False
        self.release = threading.Event()
        self.seen: list[str] = []
        relay = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self._pass(b"")

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                relay.seen.append(self.path)
                if self.path == UNLOAD and relay.refuse_unloads:
                    self._answer(503, b'{"error": {"message": "unreachable", "code": 503}}')
                    return
                if self.path == LOAD and relay.hold_loads:
                    relay.release.wait(60)
                self._pass(body)

            def _pass(self, body: bytes) -> None:
                headers = {
                    k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")
                }
                r = httpx.request(
                    self.command, relay.target + self.path, headers=headers, content=body, timeout=60
                )
                self._answer(r.status_code, r.content)

            def _answer(self, status: int, content: bytes) -> None:
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, tiny_llama: Path) -> Path:
    return build_lora_adapter(tmp_path_factory.mktemp("lora") / "race", tiny_llama, seed=5, alpha=32)


@pytest.fixture(scope="module")
def pair(cluster: Cluster) -> list[Proc]:
    return cluster.replicas(2, *LORA_FLAGS)


@pytest.fixture
def relay(pair: list[Proc]) -> Iterator[Relay]:
    r = Relay(pair[1].url)
    yield r
    r.close()


def _listed(url: str) -> list[str]:
    return [m["id"] for m in httpx.get(url + "/v1/models", timeout=5).json()["data"]]


def _complete(router: Proc, name: str) -> httpx.Response:
    body = {"model": name, "prompt": "hello", "max_tokens": 2}
    return httpx.post(router.url + "/v1/completions", json=body, timeout=60)


def test_a_missed_unload_is_sent_again_and_routes_nothing_meanwhile(
    cluster: Cluster, pair: list[Proc], relay: Relay, adapter: Path
) -> None:
    direct = pair[0]
    router = cluster.router("--replica", direct.url, "--replica", relay.url, all_routable=True)
    load = {"lora_name": "missed", "lora_path": str(adapter)}
    assert httpx.post(router.url + LOAD, json=load, timeout=60).status_code == 200
    assert wait_until(lambda: all("missed" in r["models"] for r in replicas_view(router).values()), 30)
    relay.refuse_unloads = True  # the replica behind the relay does not hear of the unload
    r = httpx.post(router.url + UNLOAD, json={"lora_name": "missed"}, timeout=60)
    assert r.status_code == 503, r.text
    assert r.json()["replicas"] == {direct.url: 200, relay.url: 503}
    assert "missed" in _listed(pair[1].url) and "missed" not in _listed(direct.url)
    # It still lists the adapter, but the router was told to unload it: nothing for it goes there.
    before = metric(router.url, "ferry:router_requests_total", {"replica": relay.url})
    for _ in range(3):
        assert _complete(router, "missed").status_code == 404
    assert metric(router.url, "ferry:router_requests_total", {"replica": relay.url}) == before
    assert metric(router.url, "ferry:router_lora_failures_total", {"op": "unload"}) == 1
    # Its restores read its list (still naming the adapter) before sending the unload again: the
    # router does not adopt the adapter back from it (router/lora_learn.py).
    assert wait_until(lambda: relay.seen.count(UNLOAD) >= 3, 30)
    lora = httpx.get(router.url + "/admin/replicas", timeout=5).json()["lora"]
    assert lora == {"adapters": {}, "unloaded": ["missed"], "conflicts": {}}
    # Reachable again: its next good probe sends the unload once more.
    relay.refuse_unloads = False
    assert wait_until(lambda: "missed" not in _listed(pair[1].url), 30)
    assert wait_until(lambda: "missed" not in replicas_view(router)[relay.url]["models"], 30)
    assert replicas_view(router)[relay.url]["routable"]
    assert _listed(direct.url) == _listed(pair[1].url)


def test_a_restore_and_an_unload_of_the_same_adapter_run_in_turn(
    cluster: Cluster, pair: list[Proc], relay: Relay, adapter: Path
) -> None:
    direct = pair[0]
    router = cluster.router("--replica", direct.url, "--log-level", "info", all_routable=True)
    load = {"lora_name": "raced", "lora_path": str(adapter)}
    assert httpx.post(router.url + LOAD, json=load, timeout=60).status_code == 200
    # A replica joins: the router's restore of the adapter onto it is held on its way.
    relay.hold_loads = True
    added: list[httpx.Response] = []  # the router answers once its first probe is done
    adder = threading.Thread(
        target=lambda: added.append(
            httpx.post(router.url + "/admin/replicas", json={"url": relay.url}, timeout=60)
        )
    )
    adder.start()
    assert wait_until(lambda: LOAD in relay.seen, 30)
    # Meanwhile a client unloads it.
    answer: list[httpx.Response] = []
    client = threading.Thread(
        target=lambda: answer.append(httpx.post(router.url + UNLOAD, json={"lora_name": "raced"}, timeout=60))
    )
    client.start()
    # Either the router holds the unload until the restore is done, or (the bug) it went on at once.
    waiting = "'raced': waiting for the change to it in progress"
    assert wait_until(lambda: waiting in router.log.read_text() or UNLOAD in relay.seen, 30)
    relay.release.set()
    client.join(60)
    adder.join(60)
    assert added and added[0].status_code in (200, 201), added and added[0].text
    assert wait_until(lambda: replicas_view(router)[relay.url]["routable"], 30)
    # The client's unload was the last word: no replica holds the adapter.
    assert "raced" not in _listed(direct.url)
    assert "raced" not in _listed(pair[1].url)
    assert answer and answer[0].status_code == 200, answer and answer[0].text
    assert answer[0].json()["replicas"] == {direct.url: 200, relay.url: 200}
    assert relay.seen.index(LOAD) < relay.seen.index(UNLOAD)


def test_a_restore_that_finds_the_adapter_loaded_meanwhile_is_done(
    cluster: Cluster, pair: list[Proc], relay: Relay, adapter: Path
) -> None:
    """Another router (here: a client straight to the replica) loads the adapter while this
    router's restore of it is on its way: the replica's "already loaded" is no failure."""
    direct = pair[0]
    router = cluster.router("--replica", direct.url, all_routable=True)
    load = {"lora_name": "met", "lora_path": str(adapter)}
    assert httpx.post(router.url + LOAD, json=load, timeout=60).status_code == 200
    relay.hold_loads = True
    added: list[httpx.Response] = []
    adder = threading.Thread(
        target=lambda: added.append(
            httpx.post(router.url + "/admin/replicas", json={"url": relay.url}, timeout=60)
        )
    )
    adder.start()
    assert wait_until(lambda: LOAD in relay.seen, 30)
    assert httpx.post(pair[1].url + LOAD, json=load, timeout=60).status_code == 200
    relay.release.set()
    adder.join(60)
    assert added and added[0].status_code == 201, added and added[0].text
    assert wait_until(lambda: replicas_view(router)[relay.url]["routable"], 30)
    assert relay.seen.count(LOAD) == 1  # not tried again: the replica holds it as the router knows it
    assert metric(router.url, "ferry:router_lora_failures_total", {"op": "restore"}) == 0
    assert "met" in _listed(pair[1].url)
