"""Uploads to the Files API stream to disk instead of being held in memory: a 20 MiB file goes in
and comes back byte for byte while the server's peak memory grows by far less than the file; a body
past ``--max-file-bytes`` is refused with 413 before the client has sent the rest; an upload cut off
midway leaves nothing in ``--batch-dir``. Peak memory is the kernel's ``VmHWM`` of the server
process, reset through ``/proc/PID/clear_refs`` before each measured request."""

from __future__ import annotations

import io
import json
import socket
from pathlib import Path

import openai
import pytest

MAX_FILE_BYTES = 32 * 1024 * 1024
UPLOAD_BYTES = 20 * 1024 * 1024
# The upload and the download each held once in memory would already pass this.
PEAK_GROWTH_BOUND = UPLOAD_BYTES // 2
BOUNDARY = "ferryboundary"


@pytest.fixture(scope="module")
def batch_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("batch-dir")


@pytest.fixture(scope="module")
def replica(tiny_llama, server_process, serve_logs, batch_dir):
    args = ["--batch-dir", str(batch_dir), "--max-file-bytes", str(MAX_FILE_BYTES)]
    srv = server_process(tiny_llama, args, serve_logs).start()
    yield srv
    srv.stop()


@pytest.fixture
def client(replica):
    with openai.OpenAI(base_url=replica.url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c
        for f in c.files.list():  # each test starts from an empty directory
            c.files.delete(f.id)


def _stored(batch_dir: Path) -> list[str]:
    return sorted(p.name for p in (batch_dir / "files").iterdir())


def _jsonl(size: int) -> bytes:
    """Batch request lines of ~1 KiB each, ``size`` bytes or a little more."""
    lines, total, i = [], 0, 0
    while total < size:
        body = {"messages": [{"role": "user", "content": f"{i:06d} " + "y" * 960}], "max_tokens": 2}
        line = json.dumps(
            {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        )
        lines.append(line.encode() + b"\n")
        total += len(lines[-1])
        i += 1
    return b"".join(lines)


def _kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(field)


def _reset_peak(pid: int) -> int:
    """Reset the process's peak resident size to its current one, which is returned."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return _kib(pid, "VmRSS")


def _head(replica, length: int | None) -> bytes:
    framing = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return (
        f"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\n{framing}\r\n"
        f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n\r\n"
    ).encode()


def _form_head() -> bytes:
    return (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n'
        "Content-Type: application/jsonl\r\n\r\n"
    ).encode()


def _read_answer(sock: socket.socket) -> tuple[int, dict]:
    """The status and JSON body of the HTTP answer on ``sock`` (sent with a Content-Length)."""
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += sock.recv(65536)
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    while len(body) < int(headers["content-length"]):
        body += sock.recv(65536)
    return int(lines[0].split()[1]), json.loads(body)


def test_upload_and_download_stream(client, replica, batch_dir) -> None:
    data = _jsonl(UPLOAD_BYTES)
    pid = replica.proc.pid
    # Warm up first (worker threads, lazy imports): what is measured is what an upload costs.
    warm = client.files.create(file=("warm.jsonl", io.BytesIO(_jsonl(2 << 20))), purpose="batch")
    client.files.content(warm.id)
    client.files.delete(warm.id)
    before = _reset_peak(pid)
    upload = client.files.create(file=("big.jsonl", io.BytesIO(data)), purpose="batch")
    grown = _kib(pid, "VmHWM") - before
    assert upload.bytes == len(data) and upload.filename == "big.jsonl"
    assert grown < PEAK_GROWTH_BOUND, f"the upload grew the server's peak memory by {grown} bytes"
    assert _stored(batch_dir) == [f"{upload.id}.data", f"{upload.id}.json"]  # no temporary left
    assert (batch_dir / "files" / f"{upload.id}.data").read_bytes() == data

    before = _reset_peak(pid)
    content = client.files.content(upload.id)
    grown = _kib(pid, "VmHWM") - before
    assert content.content == data
    assert content.response.headers["content-length"] == str(len(data))
    assert grown < PEAK_GROWTH_BOUND, f"the download grew the server's peak memory by {grown} bytes"


def test_upload_past_the_limit_is_413_at_once(client, replica, batch_dir) -> None:
    # Chunked (no length declared): the body is counted as it comes. Only one byte past the limit
    # is sent and the body is left unfinished, so the answer cannot wait for the rest.
    with socket.create_connection(("127.0.0.1", replica.port), timeout=60) as sock:
        sock.sendall(_head(replica, None))
        part = _form_head() + b"x" * (1 << 20)
        sent = 0
        while sent <= MAX_FILE_BYTES:
            sock.sendall(f"{len(part):x}\r\n".encode() + part + b"\r\n")
            sent += len(part)
            part = b"y" * (1 << 20)
        status, error = _read_answer(sock)
    assert status == 413
    assert error["error"]["code"] == "request_too_large"
    assert _stored(batch_dir) == []
    assert client.files.list().data == []


def test_upload_cut_off_leaves_nothing(client, replica, batch_dir) -> None:
    body = _form_head() + _jsonl(4 << 20)  # past Starlette's 1 MiB in-memory spool
    with socket.create_connection(("127.0.0.1", replica.port), timeout=60) as sock:
        sock.sendall(_head(replica, len(body) + 1000) + body)  # the rest never comes
    # The server takes later uploads, and only theirs are stored.
    small = _jsonl(10)
    upload = client.files.create(file=("small.jsonl", io.BytesIO(small)), purpose="batch")
    assert _stored(batch_dir) == [f"{upload.id}.data", f"{upload.id}.json"]
    assert [f.id for f in client.files.list()] == [upload.id]
    assert client.files.content(upload.id).content == small
