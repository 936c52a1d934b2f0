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


def _until(condition, what: str, timeout: float = 60) -> None:
    """Wait for ``condition``; the bound only guards against a hang."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


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
        _until(lambda: r.get(key) is not None, "never registered")
        value = json.loads(r.get(key))
        assert value["url"] == srv.url and value["role"] == "mixed" and value["model"] == srv.model_name
        assert abs(value["started"] - time.time()) < 120
        lowest = r.pttl(key)
        assert 0 < lowest <= 6000

        def refreshed() -> bool:
            nonlocal lowest
            now = r.pttl(key)
            lowest, went_up = min(lowest, now), now > lowest
            return went_up

        # Refreshed by the heartbeat (every 2 s, TTL 6 s): without it the TTL only goes down. Seen
        # going up, however late a loaded machine runs the beat.
        _until(refreshed, "the registration was never refreshed")

        body = {"prompt": "x", "max_tokens": 600, "ignore_eos": True, "stream": True}
        thread, result = _stream_in_background(srv.url, body)
        srv.proc.send_signal(signal.SIGTERM)
        # Draining from when the loop takes the signal in (at once, or late on a loaded machine).
        _until(lambda: httpx.get(srv.url + "/health").status_code == 503, "never draining")
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "draining"
        refused = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert refused.status_code == 503 and refused.headers["retry-after"].isdigit()
        _until(lambda: r.get(key) is None, "still registered")  # routers stop sending before it goes
        assert srv.proc.poll() is None  # still draining its stream
        thread.join(60)
        assert result["status"] == 200 and result["lines"][-1] == "data: [DONE]"
        assert _finish_reason(result["lines"]) == "length"  # the in-flight stream completed
        assert srv.proc.wait(60) == 0
    finally:
        srv.stop()


def test_drain_timeout_aborts_what_is_left(tiny_llama: Path, serve_logs: Path, server_process) -> None:
    srv = server_process(tiny_llama, ["--drain-timeout", "0.5"], serve_logs).start()
    try:
        body = {"prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        thread, result = _stream_in_background(srv.url, body)
        srv.proc.send_signal(signal.SIGTERM)
        thread.join(60)
        assert result["lines"][-1] == "data: [DONE]"
        assert _finish_reason(result["lines"]) == "abort"  # cut at the 0.5 s drain, not run to length
        assert srv.proc.wait(60) == 0
    finally:
        srv.stop()
