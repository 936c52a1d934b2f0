"""The router's HTTP edge as odd clients meet it, over loopback in front of a real replica: a HEAD
whose relayed answer is only a head, an HTTP/1.0 client (which cannot read chunked transfer
coding), compressed request bodies, CORS (the router's policy, not the replica's), a replica's
redirect (to a path, not to the replica), percent-encoded paths (relayed encoded, so that a
decoded CR LF cannot write a second request to the replica)."""

from __future__ import annotations

import gzip
import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from router_harness import Cluster, Proc

MODEL = "llama"


@pytest.fixture(scope="module")
def replica(cluster: Cluster) -> Proc:
    (replica,) = cluster.replicas(1)
    return replica


@pytest.fixture(scope="module")
def router(cluster: Cluster, replica: Proc) -> Proc:
    return cluster.router("--replica", replica.url)


class _Conn:
    """One client connection; ``answer`` reads one response by its framing."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=15)
        self.buf = b""

    def _fill(self) -> None:
        data = self.sock.recv(65536)
        assert data, f"connection closed after {self.buf!r}"
        self.buf += data

    def answer(self, head_request: bool = False) -> tuple[int, dict[bytes, bytes], bytes]:
        while b"\r\n\r\n" not in self.buf:
            self._fill()
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        headers = {k.lower(): v for k, v in (line.split(b": ", 1) for line in lines[1:])}
        status = int(lines[0].split(b" ")[1])
        if head_request:
            return status, headers, b""
        if b"content-length" in headers:
            end = int(headers[b"content-length"])
            while len(self.buf) < end:
                self._fill()
            body, self.buf = self.buf[:end], self.buf[end:]
            return status, headers, body
        assert headers.get(b"transfer-encoding") == b"chunked", headers
        while b"\r\n0\r\n\r\n" not in self.buf and not self.buf.startswith(b"0\r\n\r\n"):
            self._fill()
        body = b""
        while True:
            size_line, _, rest = self.buf.partition(b"\r\n")
            size = int(size_line, 16)
            self.buf = rest[size + 2 :]
            if size == 0:
                return status, headers, body
            body += rest[:size]

    def close(self) -> None:
        self.sock.close()


def _tokenize(port: int, version: bytes = b"1.1", extra: bytes = b"") -> bytes:
    body = json.dumps({"model": MODEL, "prompt": "hello there"}).encode()
    return (
        b"POST /tokenize HTTP/%s\r\nhost: 127.0.0.1:%d\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n%s\r\n%s" % (version, port, len(body), extra, body)
    )


def test_a_relayed_head_ends_with_its_head(router: Proc) -> None:
    """The replica's answer to a HEAD names the length its GET would have (RFC 9110 §9.3.2) and
    carries no body; the relay used to wait for that body (up to the 600 s read timeout), so the
    answer never ended and the client's connection was stuck."""
    conn = _Conn(router.port)
    try:
        for _ in range(2):  # the second on the same connections (client's and the router's pooled one)
            conn.sock.sendall(b"HEAD /v1/models HTTP/1.1\r\nhost: 127.0.0.1:%d\r\n\r\n" % router.port)
            status, headers, _ = conn.answer(head_request=True)
            assert status == 405 and headers[b"allow"] == b"GET"  # the replica's, as vLLM's
        conn.sock.sendall(_tokenize(router.port))
        status, _, body = conn.answer()
        assert status == 200 and json.loads(body)["count"] > 0
    finally:
        conn.close()


def test_an_http10_client_gets_a_relayed_answer_framed_by_its_length(router: Proc) -> None:
    """A relayed answer the replica framed by Content-Length keeps it: re-framed as chunks, an
    HTTP/1.0 client (which cannot read chunked coding, RFC 9112 §6.1) read the chunk sizes as body."""
    conn = _Conn(router.port)
    try:
        conn.sock.sendall(_tokenize(router.port, b"1.0"))
        status, headers, body = conn.answer()
        assert status == 200 and b"transfer-encoding" not in headers
        assert json.loads(body)["count"] > 0 and conn.buf == b""
        assert conn.sock.recv(1) == b""  # HTTP/1.0: the router closes after the answer
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("path", "payload"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),  # parsed and keyed
        ("/tokenize", {"prompt": "hi"}),  # relayed as it comes
        ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}]}),  # Anthropic's shape
    ],
)
def test_a_compressed_body_is_refused(router: Proc, path: str, payload: dict) -> None:
    """As a replica answers it (tests/server/test_http_edge.py); a keyed route used to fail with
    "not valid JSON: 'utf-8' codec can't decode byte 0x8b"."""
    body = gzip.compress(json.dumps({"model": MODEL, "max_tokens": 2, **payload}).encode())
    conn = _Conn(router.port)
    try:
        conn.sock.sendall(
            b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-encoding: gzip\r\n"
            b"content-length: %d\r\n\r\n%s" % (path.encode(), len(body), body)
        )
        status, headers, answer = conn.answer()
        message = "Content-Encoding 'gzip' is not supported: send the request body uncompressed."
        assert headers[b"accept-encoding"] == b"identity"
        if path == "/v1/messages":  # Anthropic's 400 with its error_code, as a replica answers it
            error = json.loads(answer)
            assert status == 400 and error.pop("request_id") == headers[b"request-id"].decode()
            assert error == {
                "type": "error",
                "error": {
                    "type": "invalid_request_error",
                    "message": message,
                    "details": {"error_code": "request_body_encoding_unsupported"},
                },
            }
        else:
            assert status == 415
            assert json.loads(answer) == {
                "error": {
                    "message": message,
                    "type": "UnsupportedMediaTypeError",
                    "param": None,
                    "code": "unsupported_content_encoding",
                }
            }
        conn.sock.sendall(_tokenize(router.port))  # the connection goes on
        assert conn.answer()[0] == 200
    finally:
        conn.close()


def test_the_routers_cors_policy_holds_on_relayed_answers(cluster: Cluster, replica: Proc) -> None:
    """The replica allows every origin (vLLM's default) and said so on its answers; relayed, its
    ``access-control-allow-origin: *`` let a browser page of an origin the router refuses read them."""
    router = cluster.router("--replica", replica.url, "--allowed-origins", '["https://app.example"]')
    tokenize = {"model": MODEL, "prompt": "hi"}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with httpx.Client(base_url=router.url, timeout=30) as client:
        for origin, allowed in (
            ("https://app.example", ["https://app.example"]),
            ("https://evil.example", []),
        ):
            headers = {"Origin": origin}
            answers = [
                client.get("/v1/files", headers=headers),  # relayed as it comes
                client.post("/tokenize", json=tokenize, headers=headers),
                client.post("/v1/chat/completions", json=chat, headers=headers),  # a generation
                client.post("/v1/chat/completions", json={**chat, "stream": True}, headers=headers),
                client.post("/v1/chat/completions", json={**chat, "n": 0}, headers=headers),  # an error
            ]
            for answer in answers:
                assert answer.status_code in (200, 400), answer.text
                assert answer.headers.get_list("access-control-allow-origin") == allowed, answer.request


def test_a_replicas_redirect_is_followed_through_the_router(router: Proc, replica: Proc) -> None:
    """FastAPI redirects a path with a trailing slash, to a URL built from the Host the router sent:
    the replica's own address, which sent the client past the router (or nowhere it could reach)."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with httpx.Client(base_url=router.url, timeout=30) as client:
        moved = client.post("/v1/chat/completions/?x=1", json=chat)
        assert moved.status_code == 307
        assert moved.headers["location"] == "/v1/chat/completions?x=1"
        answer = client.post("/v1/chat/completions/", json=chat, follow_redirects=True)
        assert answer.status_code == 200 and answer.url == router.url + "/v1/chat/completions"
        assert answer.json()["usage"]["completion_tokens"] == 2
    direct = httpx.post(replica.url + "/v1/chat/completions/", json=chat, timeout=30)
    assert direct.headers["location"] == replica.url + "/v1/chat/completions"  # as the replica says it


class _Targets(BaseHTTPRequestHandler):
    """A replica that answers everything with an empty model list and records the request target
    (as it came on the wire) of every request for a file."""

    protocol_version = "HTTP/1.1"
    targets: list[str] = []

    def _answer(self) -> None:
        if self.path.startswith("/v1/files"):
            self.targets.append(self.path)
        self.rfile.read(int(self.headers.get("content-length") or 0))
        body = b'{"object": "list", "data": []}'
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def targets_router(cluster: Cluster) -> Iterator[Proc]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Targets)
    _Targets.targets = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield cluster.router("--replica", f"http://127.0.0.1:{server.server_address[1]}")
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize(
    ("target", "relayed"),
    [
        ("/v1/files/a%20b?limit=2", "/v1/files/a%20b?limit=2"),
        ("/v1/files/%2541%3Fx%23y", "/v1/files/%2541%3Fx%23y"),  # "%41?x#y": one segment
        ("/v1/files/%C3%A9%ff", "/v1/files/%C3%A9%EF%BF%BD"),  # what the replica would decode
        # A decoded CR LF used to end the relayed request line and head early: the replica read a
        # second request (here a POST /sleep with whatever headers the router added).
        (
            "/v1/files/x%20HTTP/1.1%0D%0AHost:%20a%0D%0AContent-Length:%200%0D%0A%0D%0APOST%20/sleep",
            "/v1/files/x%20HTTP/1.1%0D%0AHost:%20a%0D%0AContent-Length:%200%0D%0A%0D%0APOST%20/sleep",
        ),
    ],
)
def test_a_percent_encoded_path_is_relayed_encoded(targets_router: Proc, target: str, relayed: str) -> None:
    conn = _Conn(targets_router.port)
    try:
        conn.sock.sendall(b"GET %s HTTP/1.1\r\nhost: x\r\n\r\n" % target.encode())
        assert conn.answer()[0] == 200
    finally:
        conn.close()
    assert _Targets.targets == [relayed]


def test_a_file_upload_is_bounded_by_max_file_bytes(cluster: Cluster) -> None:
    """A batch's input file is larger than a request: the router bounds ``POST /v1/files`` by
    ``--max-file-bytes`` (the replica's own bound by default), every other body by
    ``--max-request-bytes``."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Targets)
    _Targets.targets = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        replica = f"http://127.0.0.1:{server.server_address[1]}"
        router = cluster.router(
            "--replica", replica, "--max-request-bytes", "1024", "--max-file-bytes", "4096"
        )
        with httpx.Client(base_url=router.url, timeout=30) as client:
            assert client.post("/v1/files", content=b"x" * 3000).status_code == 200
            assert _Targets.targets == ["/v1/files"]
            big = client.post("/v1/files", content=b"x" * 5000)
            assert big.status_code == 413
            assert (
                big.json()["error"]["message"]
                == "request body exceeds 4096 bytes (the router's --max-file-bytes)"
            )
            other = client.post("/tokenize", content=b"x" * 3000)
            assert other.status_code == 413
            assert other.json()["error"]["message"] == (
                "request body exceeds 1024 bytes (the router's --max-request-bytes)"
            )
        assert _Targets.targets == ["/v1/files"]
    finally:
        server.shutdown()
        server.server_close()
