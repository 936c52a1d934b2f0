"""`ferry run-batch` never holds its input or its output whole: the input is read a line at a time
(a URL's body streamed to a temporary file first), the answers are spooled to a temporary file and
written (or PUT, with a Content-Length) in input order at the end.

Measured exactly with ``tracemalloc`` (every Python allocation of the process, the engine's and the
loopback object store's threads included): a run of a 12.5 MiB input with 25 MiB of answers costs
no more than one of 4 lines, give or take a few MiB, where holding either file whole would cost
over 12 MiB (measured: +2 MiB, where reading and answering whole cost +75 MiB with local files and
+113 MiB with URLs). The lines ask the real app for a model it does not serve, a 64 KiB name its 404
echoes (so the answers are as large as the requests and cost the engine nothing); every 25th line is
a real completion, which takes engine steps while the 404s after it are answered at once, so the
answers come out of input order and the output is put back in order from the spool.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import threading
import tracemalloc
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from ferry.cli import main

NAME_CHARS = 64 * 1024
LARGE = 200  # lines of a 64 KiB model name: a 12.5 MiB input, answers of 25 MiB (the name twice)
SMALL = 4
REAL_EVERY = 25
# Holding the large input whole once would already cost ~12 MiB more than the small run, its
# answers ~25 MiB; reading ahead (1 MiB) and the requests in flight cost about 2 MiB.
GROWTH_BOUND = 8 * 1024 * 1024


def _request(i: int) -> dict:
    if i % REAL_EVERY == 0:
        body = {"prompt": f"The quick brown fox {i}", "max_tokens": 2, "temperature": 0}
        return {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}
    model = f"{i:06d}" + "m" * NAME_CHARS
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}


def _write_input(path: Path, n: int) -> None:
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps(_request(i)) + "\n")


def _check_output(lines: Iterator[bytes], n: int) -> None:
    """Every answer, in input order, read a line at a time."""
    count = 0
    for i, raw in enumerate(lines):
        line = json.loads(raw)
        assert line["custom_id"] == f"r{i}"
        if i % REAL_EVERY == 0:
            assert line["error"] is None
            assert line["response"]["body"]["usage"]["completion_tokens"] == 2
        else:
            model = _request(i)["body"]["model"]
            assert line["response"]["status_code"] == 404
            assert line["error"] == {
                "code": "model_not_found",
                "message": f"The model `{model}` does not exist.",
            }
        count += 1
    assert count == n


def _run(model: Path, source: str, target: str) -> int:
    args = ["run-batch", "-i", source, "-o", target, "--model", str(model), "--num-threads", "1"]
    return main([*args, "--max-batch-concurrency", "4", "--deterministic"])


def _measured(model: Path, source: str, target: str) -> int:
    """Allocation peak over the live memory before, while ``ferry run-batch`` runs (the model's
    load included, the same in every run)."""
    gc.collect()
    before = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    assert _run(model, source, target) == 0
    return tracemalloc.get_traced_memory()[1] - before


class _DiskBucket(BaseHTTPRequestHandler):
    """A loopback object store over a directory: GET streams a file out, PUT streams one in (a
    Content-Length required, as a pre-signed URL requires), each 64 KiB at a time."""

    root: Path
    puts: list[dict[str, str]] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        path = self.root / self.path.lstrip("/")
        if not path.is_file():
            self.send_response(404)
            self.send_header("content-length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("content-length", str(path.stat().st_size))
        self.end_headers()
        with path.open("rb") as f:
            shutil.copyfileobj(f, self.wfile, 1 << 16)

    def do_PUT(self) -> None:  # noqa: N802
        self.puts.append({k.lower(): v for k, v in self.headers.items()})
        if "content-length" not in self.headers:
            self.send_response(411)
            self.send_header("content-length", "0")
            self.end_headers()
            return
        left = int(self.headers["content-length"])
        with (self.root / self.path.lstrip("/")).open("wb") as f:
            while left:
                chunk = self.rfile.read(min(left, 1 << 16))
                assert chunk
                f.write(chunk)
                left -= len(chunk)
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def bucket(tmp_path: Path) -> Iterator[tuple[str, Path, type[_DiskBucket]]]:
    root = tmp_path / "bucket"
    root.mkdir()
    handler = type("Bucket", (_DiskBucket,), {"root": root, "puts": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", root, handler
    finally:
        server.shutdown()
        thread.join()
        server.server_close()


def test_run_batch_memory_stays_flat(tiny_llama: Path, tmp_path: Path, bucket) -> None:
    base, root, handler = bucket
    for n in (SMALL, LARGE):
        _write_input(tmp_path / f"in{n}.jsonl", n)
        shutil.copy(tmp_path / f"in{n}.jsonl", root / f"in{n}.jsonl")
    tracemalloc.start()
    try:
        _measured(tiny_llama, str(tmp_path / f"in{SMALL}.jsonl"), str(tmp_path / "warm.jsonl"))
        local = {n: _measured(tiny_llama, str(tmp_path / f"in{n}.jsonl"), str(tmp_path / f"out{n}.jsonl"))
                 for n in (SMALL, LARGE)}  # fmt: skip
        url = {
            n: _measured(tiny_llama, f"{base}/in{n}.jsonl", f"{base}/out{n}.jsonl") for n in (SMALL, LARGE)
        }
    finally:
        tracemalloc.stop()
    print(f"peak growth (B), local files: {local}, URLs: {url}")
    for n in (SMALL, LARGE):
        for out in (tmp_path / f"out{n}.jsonl", root / f"out{n}.jsonl"):
            with out.open("rb") as f:
                _check_output(f, n)
    # Each output went to the object store in one PUT with its length, never chunked.
    assert [(h.get("content-length"), h.get("transfer-encoding")) for h in handler.puts] == [
        (str((root / f"out{n}.jsonl").stat().st_size), None) for n in (SMALL, LARGE)
    ]
    assert local[LARGE] < local[SMALL] + GROWTH_BOUND, local
    assert url[LARGE] < url[SMALL] + GROWTH_BOUND, url


def _chat(custom_id: str, model: str | None = None) -> dict:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0}
    if model is not None:
        body["model"] = model
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_lines_end_at_newline_only(tiny_llama: Path, tmp_path: Path) -> None:
    # A raw CR between JSON tokens is whitespace, not a line end (as the README and the Batch API
    # say); reading the file as text split that line in two bad ones. A CRLF end, a blank CRLF line
    # and a leading byte order mark change nothing.
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    second = json.dumps(_chat("b")).replace('"method"', '\r"method"')
    source.write_bytes(
        b"\xef\xbb\xbf" + json.dumps(_chat("a")).encode() + b"\r\n\r\n" + second.encode() + b"\n"
    )
    assert _run(tiny_llama, str(source), str(target)) == 0
    out = _read(target)
    assert [(o["custom_id"], o["error"]) for o in out] == [("a", None), ("b", None)]


def test_input_from_a_pipe(tiny_llama: Path, tmp_path: Path) -> None:
    # A pipe (``-i /dev/stdin``, ``-i <(zcat in.jsonl.gz)``) is read once: the lines, counted first,
    # come from a copy of it.
    source, target = tmp_path / "in.fifo", tmp_path / "out.jsonl"
    os.mkfifo(source)
    data = "".join(json.dumps(_chat(f"p{i}")) + "\n" for i in range(3)).encode()

    def feed() -> None:
        with source.open("wb") as f:
            f.write(data)

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    assert _run(tiny_llama, str(source), str(target)) == 0
    writer.join(timeout=5)
    out = _read(target)
    assert [(o["custom_id"], o["error"]) for o in out] == [(f"p{i}", None) for i in range(3)]


def test_url_input_is_decoded_as_text(tiny_llama: Path, tmp_path: Path, bucket) -> None:
    # A URL's body is decoded as httpx's ``Response.text`` decodes it (UTF-8 unless its charset says
    # otherwise, a bad byte replaced), as when it was read whole: the line still runs.
    base, root, _ = bucket
    line = json.dumps(_chat("u", model="MODEL")).encode().replace(b"MODEL", b"bad\xffname")
    (root / "in.jsonl").write_bytes(line + b"\n")
    target = tmp_path / "out.jsonl"
    assert _run(tiny_llama, f"{base}/in.jsonl", str(target)) == 0
    [out] = _read(target)
    assert out["error"] == {"code": "model_not_found", "message": "The model `bad\ufffdname` does not exist."}


@pytest.mark.parametrize(
    "bad",
    [b"\xff", b"\xe2\x82"],  # an invalid start byte; a sequence cut short (two bytes, one message)
)
def test_undecodable_input_is_refused_at_its_offset(
    tiny_llama: Path, tmp_path: Path, capsys, bad: bytes
) -> None:
    # Found before the model loads, with the offset of the bad byte in the whole file (the
    # message decoding the whole file gives), not in its line; nothing is written.
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    good = "".join(json.dumps(_chat(f"g{i}")) + "\n" for i in range(3)).encode()
    data = good + b'{"custom_id": "x' + bad + b'"}\n' + good
    source.write_bytes(data)
    with pytest.raises(UnicodeDecodeError) as whole:
        data.decode("utf-8")
    assert whole.value.start > len(good)
    assert _run(tiny_llama, str(source), str(target)) == 2
    assert capsys.readouterr().err == f"ferry run-batch: error: cannot read {source}: {whole.value}\n"
    assert not target.exists()
