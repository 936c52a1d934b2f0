"""A stream whose replica dies and that cannot be resumed (the backend sends no token ids) ends
with a clear SSE error event, never a hang; the router stays healthy. Uses the bench stand-in
backend (a real OpenAI-compatible server that starts in a fraction of a second)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import httpx
from router_harness import REPO, Proc, free_port, metric, replicas_view, wait_until


def _standin(port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            str(REPO / "bench/standin.py"),
            "--port",
            str(port),
            "--tokens",
            "200",
            "--delay-ms",
            "100",  # 20 s for the 200 tokens: the stream still runs when the test kills its backend
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def test_unresumable_stream_ends_with_an_error_event(tmp_path) -> None:
    ports = [free_port(), free_port()]
    backends = [_standin(p) for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    port = free_port()
    router = Proc(
        [
            "router",
            "--port",
            str(port),
            "--policy",
            "round_robin",
            "--health-interval",
            "0.2",
            "--replica",
            urls[0],
            "--replica",
            urls[1],
        ],
        port,
        tmp_path / "router.log",
    )
    try:
        router.start().wait_http(30)
        assert wait_until(lambda: httpx.get(router.url + "/health").json()["replicas"]["routable"] == 2)
        body = {
            "model": "standin",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 200,
            "stream": True,
        }
        events = []
        with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=30) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                if len(events) == 4:
                    backends[0].send_signal(signal.SIGKILL)  # round robin: the first backend serves it
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert "cannot be resumed" in error["message"] and error["code"] == "bad_gateway"
        assert 4 <= len(events) < 100  # cut short, not hung, not continued from scratch
        assert metric(router.url, "ferry:router_failovers_total") == 0
        # The next request goes to the survivor (the dead one is ejected or retried around).
        ok = httpx.post(
            router.url + "/v1/completions", json={"model": "standin", "prompt": "x", "max_tokens": 2}
        )
        assert ok.status_code == 200
        assert wait_until(lambda: replicas_view(router)[urls[0]]["health"] == "ejected", timeout=60)
    finally:
        router.stop()
        for b in backends:
            b.kill()
            b.wait()
