"""SIGTERM on `ferry router`: in-flight streams finish within --drain-timeout, then the process exits 0.

The upstream is bench/standin.py streaming slowly: the router's own shutdown is under test,
so the backend only has to be a real HTTP server whose stream outlives the signal.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from router_harness import REPO, Proc, free_port


def _standin(tmp: Path, delay_ms: int, tokens: int) -> subprocess.Popen:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "bench/standin.py", "--port", str(port), "--tokens", str(tokens),
         "--delay-ms", str(delay_ms)],
        cwd=REPO, stdout=open(tmp / "standin.log", "ab"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    proc.port = port  # type: ignore[attr-defined]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("stand-in did not start")


def _stream_tokens(url: str, out: dict) -> None:
    body = {"model": "standin", "prompt": "hi", "max_tokens": 40, "stream": True}
    chunks = 0
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    payload = json.loads(line[6:])
                    chunks += len(payload.get("choices", []))
                    out["first"].set()
                elif line == "data: [DONE]":
                    out["done"] = True
    except httpx.HTTPError as e:
        out["error"] = repr(e)
    out["chunks"] = chunks


def _run(tmp: Path, drain_timeout: float, delay_ms: int = 50) -> tuple[dict, int, float]:
    backend = _standin(tmp, delay_ms=delay_ms, tokens=40)  # 40 tokens: ~2 s per stream at 50 ms
    router = Proc(
        ["router", "--port", str(port := free_port()), "--replica", f"http://127.0.0.1:{backend.port}",
         "--policy", "round_robin", "--drain-timeout", str(drain_timeout)],
        port, tmp / f"router-{drain_timeout}.log",
    ).start().wait_http()  # fmt: skip
    try:
        out: dict = {"first": threading.Event(), "done": False}
        t = threading.Thread(target=_stream_tokens, args=(router.url, out))
        t.start()
        assert out["first"].wait(60)
        t0 = time.monotonic()
        router.proc.send_signal(signal.SIGTERM)
        rc = router.proc.wait(timeout=60)
        exited_after = time.monotonic() - t0
        t.join(60)
        return out, rc, exited_after
    finally:
        router.stop()
        backend.kill()
        backend.wait()


def test_sigterm_lets_the_in_flight_stream_finish(tmp_path: Path) -> None:
    out, rc, _ = _run(tmp_path, drain_timeout=20)
    assert rc == 0
    assert out["done"] is True and "error" not in out
    assert out["chunks"] == 40  # every token of the stream arrived


def test_sigterm_drain_is_bounded(tmp_path: Path) -> None:
    # A 60 s stream (1.5 s a token), cut at the 0.5 s drain timeout, not waited for: it never
    # ends, and the router exits long before it would have (however slowly a loaded machine exits).
    out, rc, exited_after = _run(tmp_path, drain_timeout=0.5, delay_ms=1500)
    assert rc == 0
    assert out["done"] is False
    assert exited_after < 30
