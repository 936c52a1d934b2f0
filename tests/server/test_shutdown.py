"""Replica lifecycle: Redis registration heartbeat, SIGTERM drain, drain timeout."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx
import redis


def _stream_in_background(url: str, body: dict) -> tuple[threading.Thread, dict]:
    """Start a streaming completion; ``result`` gets 'first' when the first chunk arrived, then 'text'."""
    result: dict = {"first": threading.Event()}

    def run() -> None:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            chunks = []
            for line in r.iter_lines():
                if line:
                    chunks.append(line)
                    result["first"].set()
            result["status"] = r.status_code
            result["lines"] = chunks

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert result["first"].wait(30), "stream never started"
    return thread, result


def _finish_reason(lines: list[str]) -> str | None:
    reasons = [
        json.loads(x[6:])["choices"][0]["finish_reason"] for x in lines[:-1] if json.loads(x[6:])["choices"]
    ]
    return reasons[-1]


def test_register_heartbeat_then_sigterm_drains(
    tiny_llama: Path, serve_logs: Path, server_process, redis_url
) -> None:
    srv = server_process(tiny_llama, ["--register", redis_url, "--drain-timeout", "30"], serve_logs).start()
    try:
        r = redis.Redis.from_url(redis_url)
        key = f"ferry:replica:{srv.url}"
        # /health can answer while the first heartbeat is still in flight (same event loop).
        deadline = time.monotonic() + 10
        while r.get(key) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        value = json.loads(r.get(key))
        assert value["url"] == srv.url and value["role"] == "mixed" and value["model"] == srv.model_name
        assert abs(value["started"] - time.time()) < 120
        assert 0 < r.pttl(key) <= 6000
        time.sleep(2.5)
        # Refreshed by the heartbeat (every 2 s, TTL 6 s): without it the TTL would be below 3.5 s
        # from here on; a loaded machine may run the beat a little late, so wait for it a while.
        deadline = time.monotonic() + 3.0
        while r.pttl(key) <= 4000 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert r.pttl(key) > 4000

        body = {"prompt": "x", "max_tokens": 600, "ignore_eos": True, "stream": True}
        thread, result = _stream_in_background(srv.url, body)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "draining"
        refused = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert refused.status_code == 503 and refused.headers["retry-after"].isdigit()
        assert r.get(key) is None  # routers stop sending before the replica goes
        thread.join(60)
        assert result["status"] == 200 and result["lines"][-1] == "data: [DONE]"
        assert _finish_reason(result["lines"]) == "length"  # the in-flight stream completed
        assert srv.proc.wait(30) == 0
    finally:
        srv.stop()


def test_drain_timeout_aborts_what_is_left(tiny_llama: Path, serve_logs: Path, server_process) -> None:
    srv = server_process(tiny_llama, ["--drain-timeout", "0.5"], serve_logs).start()
    try:
        body = {"prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        thread, result = _stream_in_background(srv.url, body)
        start = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        thread.join(30)
        assert result["lines"][-1] == "data: [DONE]"
        assert _finish_reason(result["lines"]) == "abort"
        assert srv.proc.wait(30) == 0
        assert time.monotonic() - start < 10
    finally:
        srv.stop()
