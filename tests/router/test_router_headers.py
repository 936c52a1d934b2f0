"""Headers at the router's edges: a client's ``Expect: 100-continue`` (curl sends it for bodies over
1 MiB), hop-by-hop headers and those its ``Connection`` names stay on the client's hop; interim 1xx
answers from a replica are skipped; an empty ``X-Session-Id`` counts as absent (all over loopback)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from router_harness import Cluster, Proc, replicas_view

from router.policies.session import rendezvous_pick
from router.upstream import UpstreamBroken, UpstreamClient

MODEL = "llama"


@pytest.fixture(scope="module")
def pair(cluster: Cluster) -> list[Proc]:
    return cluster.replicas(2)


def _read_head(sock: socket.socket, buf: bytes) -> tuple[bytes, bytes]:
    """One response head from ``sock`` (after what ``buf`` holds): (head, bytes read past it)."""
    while b"\r\n\r\n" not in buf:
        data = sock.recv(65536)
        assert data, f"connection closed after {buf!r}"
        buf += data
    head, _, rest = buf.partition(b"\r\n\r\n")
    return head, rest


def _post_expecting_continue(port: int, path: str, body: bytes, extra: bytes = b"") -> tuple[bytes, bytes]:
    """POST as curl does with ``Expect: 100-continue``: the head, then the body once the server
    answered ``100 Continue``. Returns the final response's head and its whole body (chunked
    transfer coding removed)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            b"POST %s HTTP/1.1\r\nhost: 127.0.0.1:%d\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nexpect: 100-continue\r\n%s\r\n" % (path.encode(), port, len(body), extra)
        )
        interim, rest = _read_head(sock, b"")
        assert interim == b"HTTP/1.1 100 Continue"
        sock.sendall(body)
        head, rest = _read_head(sock, rest)
        fields = dict(line.lower().split(b": ", 1) for line in head.split(b"\r\n")[1:])
        if b"content-length" in fields:
            end = int(fields[b"content-length"])
            while len(rest) < end:
                rest += sock.recv(65536)
            return head, rest
        while not rest.endswith(b"\r\n0\r\n\r\n"):  # chunked: to the last chunk
            rest += sock.recv(65536)
        return head, _dechunk(rest)


def _dechunk(wire: bytes) -> bytes:
    out, pos = [], 0
    while True:
        eol = wire.index(b"\r\n", pos)
        size = int(wire[pos:eol], 16)
        if size == 0:
            return b"".join(out)
        out.append(wire[eol + 2 : eol + 2 + size])
        pos = eol + 2 + size + 2


@pytest.mark.parametrize("stream", [False, True])
def test_expect_100_continue_is_answered_at_once(cluster: Cluster, pair: list[Proc], stream: bool) -> None:
    """The replica used to get the Expect too; its interim 100 was taken for the answer, which then
    waited for the replica to drop the connection (~30 s) and reached the client as status 100."""
    router = cluster.router("--replica", pair[0].url)
    body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 3, "stream": stream}).encode()
    head, got = _post_expecting_continue(router.port, "/v1/completions", body)
    assert head.split(b"\r\n")[0] == b"HTTP/1.1 200 OK"
    if stream:
        events = got.split(b"\n\n")
        assert events[-2:] == [b"data: [DONE]", b""]
        finishes = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events[:-2]]
        assert finishes[-1] == "length" and finishes.count(None) == len(finishes) - 1
    else:
        answer = json.loads(got)
        assert answer["object"] == "text_completion" and answer["usage"]["completion_tokens"] == 3


class _Recorder(BaseHTTPRequestHandler):
    """A replica that answers health probes and records the head of every POST it gets."""

    protocol_version = "HTTP/1.1"  # keep-alive, and (as servers do) 100 Continue when asked
    heads: list[list[tuple[str, str]]] = []

    def do_GET(self) -> None:
        self._answer(b'{"object": "list", "data": []}')

    def do_POST(self) -> None:
        self.heads.append([(k.lower(), v) for k, v in self.headers.items()])
        self._answer(b'{"tokens": [1, 2]}')

    def _answer(self, body: bytes) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def recorder() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    _Recorder.heads = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_hop_by_hop_and_connection_listed_headers_stay_on_the_clients_hop(
    cluster: Cluster, recorder: str
) -> None:
    router = cluster.router("--replica", recorder)
    extra = (
        b"connection: keep-alive, X-Hop-Token\r\nx-hop-token: secret\r\n"
        b"proxy-connection: keep-alive\r\nkeep-alive: timeout=5\r\nte: trailers\r\nx-kept: yes\r\n"
    )
    head, got = _post_expecting_continue(router.port, "/tokenize", b'{"prompt": "hi"}', extra)
    assert head.split(b"\r\n")[0] == b"HTTP/1.1 200 OK" and got == b'{"tokens": [1, 2]}'
    (received,) = _Recorder.heads
    request_id = dict(received)["x-request-id"]
    assert received == [
        ("host", recorder[len("http://") :]),
        ("content-type", "application/json"),
        ("x-kept", "yes"),
        ("x-request-id", request_id),
        ("accept-encoding", "identity"),
        ("content-length", "16"),
    ]


async def test_interim_1xx_answers_are_skipped_and_the_connection_kept() -> None:
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        for _ in range(2):
            head = await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(int(head.split(b"content-length: ")[1].split(b"\r\n")[0]))
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await writer.drain()
            writer.write(b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\n\r\n")
            await writer.drain()
            writer.write(b"HTTP/1.1 200 OK\r\nx-final: 1\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    client = UpstreamClient(read_timeout=5)
    for _ in range(2):
        resp = await client.request("POST", url, "/v1/x", [], b"{}")
        assert (resp.status_code, resp.headers.raw) == (200, [(b"x-final", b"1"), (b"content-length", b"2")])
        assert await asyncio.wait_for(resp.aread(), 5) == b"ok"
        await resp.aclose()
    assert connections == 1  # the interim heads left the connection reusable
    await client.aclose()
    server.close()


async def test_an_unasked_protocol_switch_is_a_broken_answer() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\n\r\n\x81\x00")
        await writer.drain()

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    client = UpstreamClient(read_timeout=5)
    with pytest.raises(UpstreamBroken, match="101"):
        await client.request("GET", f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", "/", [], b"")
    await client.aclose()
    server.close()


def test_an_empty_session_header_leaves_the_body_key_in_charge(cluster: Cluster, pair: list[Proc]) -> None:
    a, b = pair
    router = cluster.router("--replica", a.url, "--replica", b.url, "--policy", "session")
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1, "user": "alice"}
    before = {u: r["total_requests"] for u, r in replicas_view(router).items()}
    for _ in range(6):
        r = httpx.post(router.url + "/v1/completions", json=body, headers={"X-Session-Id": ""}, timeout=30)
        assert r.status_code == 200
    after = replicas_view(router)
    home = rendezvous_pick("alice", [a.url, b.url])
    assert {u: after[u]["total_requests"] - before[u] for u in after} == {
        u: 6 if u == home else 0 for u in (a.url, b.url)
    }
