"""`ferry up` end to end: a real cluster (router, workers of a tiny model, redis-server) as
subprocesses, the OpenAI SDK as client, a worker killed with SIGKILL, and SIGTERM tear-down."""

from __future__ import annotations

import http.client
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import redis
from conftest import REPO, alive, free_port, wait_gone

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci("


def health(url: str) -> int:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=2)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    except OSError:
        return 0
    finally:
        conn.close()


def test_up_serves_restarts_a_crashed_worker_and_stops_everything(tiny_llama: Path, start_up) -> None:
    router_port = free_port()
    up = start_up(
        f"""
model: {tiny_llama}
router: {{port: {router_port}, policy: round_robin, args: [--health-interval, "0.5"]}}
mixed: {{replicas: 2, threads: 1}}
kv_tier: {{redis: {{port: null}}}}
drain_timeout: 5
restart: {{initial_delay: 0.5}}
"""
    )
    up.wait_for(r"^\[up\] ready: http://127\.0\.0\.1:\d+ \(router; 2 mixed; KV tier redis://", 180)
    state = up.state()
    assert state["ready"] is True and state["endpoint"] == f"http://127.0.0.1:{router_port}"
    pids = up.pids()
    assert sorted(pids) == ["mixed-0", "mixed-1", "redis", "router"]
    assert all(alive(pid) for pid in pids.values())
    urls = {p["name"]: p["url"] for p in state["processes"]}
    # Each child's log lines come prefixed with its name.
    out = up.output()
    for name in ("redis", "mixed-0", "mixed-1"):
        assert f"\n[{name}] " in out

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{router_port}/v1", api_key="none", max_retries=0)
    chat = client.chat.completions.create(
        model="llama", messages=[{"role": "user", "content": PROMPT}], max_tokens=8, temperature=0
    )
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 8
    whole = client.completions.create(model="llama", prompt=PROMPT, max_tokens=8, temperature=0)
    pieces = [
        c.choices[0].text
        for c in client.completions.create(
            model="llama", prompt=PROMPT, max_tokens=8, temperature=0, stream=True
        )
        if c.choices
    ]
    assert len(pieces) >= 2 and "".join(pieces) == whole.choices[0].text
    # The workers share the child redis-server as their KV tier: full prompt blocks land there.
    tier = redis.Redis.from_url(state["kv_tier"])
    deadline = time.monotonic() + 60
    while not tier.keys("ferry:kv:*") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert tier.keys("ferry:kv:*")

    # SIGKILL one worker: the router keeps answering from the other, ferry up starts it again.
    victim = pids["mixed-0"]
    subprocess.run(["kill", "-9", str(victim)], check=True)
    for _ in range(4):
        again = client.completions.create(model="llama", prompt=PROMPT, max_tokens=8, temperature=0)
        assert again.choices[0].text == whole.choices[0].text
    up.wait_for(rf"^\[up\] mixed-0 \(pid {victim}\) exited with signal SIGKILL; restarting in 0\.5 s", 10)
    line = up.wait_for(r"^\[up\] mixed-0 is healthy again \(pid (\d+)\)", 120)
    new_pid = int(line.group(1))
    assert new_pid != victim and not alive(victim)
    restarted = next(p for p in up.state()["processes"] if p["name"] == "mixed-0")
    assert (
        restarted["pid"] == new_pid and restarted["pids"] == [victim, new_pid] and restarted["restarts"] == 1
    )
    assert health(urls["mixed-0"]) == 200
    for _ in range(4):
        again = client.completions.create(model="llama", prompt=PROMPT, max_tokens=8, temperature=0)
        assert again.choices[0].text == whole.choices[0].text

    # SIGTERM: everything drains and stops, ferry up exits 0, not one process is left.
    every_pid = [*up.pids().values(), victim]
    assert sorted(up.started_pids()) == sorted(every_pid)
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(60) == 0
    assert wait_gone(every_pid, 60) == []
    for pid in every_pid:
        with pytest.raises(ProcessLookupError):
            import os

            os.kill(pid, 0)
    assert not up.state_file.exists()
    out = up.output()
    assert "[up] SIGTERM: draining (a second signal stops at once)" in out
    assert out.rstrip().endswith("[up] stopped")


@pytest.fixture
def receiver():
    """A real OTLP receiver (grpc and http) in this process."""
    from tests.server.otlp_receiver import Receiver

    both = Receiver()
    yield both
    both.close()


def test_default_topology_prefill_and_decode_pools_serve(tiny_llama: Path, start_up, receiver) -> None:
    """A file that names no pool gets the default cluster: 1 prefill + 1 decode + a child Redis.
    With --otlp-traces-endpoint (to a real OTLP receiver here) the router and the worker that
    answers export their spans of a request into one trace, each under its component's name."""
    router_port = free_port()
    config = f"model: {tiny_llama}\nrouter: {{port: {router_port}}}\ndrain_timeout: 5\n"
    config += "env: {OTEL_BSP_SCHEDULE_DELAY: '50'}\n"  # spans leave 50 ms after they end
    up = start_up(config, "--otlp-traces-endpoint", receiver.grpc.endpoint)
    up.wait_for(
        r"^\[up\] ready: .* \(router; 1 prefill, 1 decode; KV tier redis://127\.0\.0\.1:\d+/0\)$", 180
    )
    pids = up.pids()
    assert sorted(pids) == ["decode-0", "prefill-0", "redis", "router"]
    argv = {p["name"]: p["argv"] for p in up.state()["processes"]}
    assert argv["prefill-0"][argv["prefill-0"].index("--role") + 1] == "prefill"
    assert argv["decode-0"][argv["decode-0"].index("--role") + 1] == "decode"
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{router_port}/v1", api_key="none", max_retries=0)
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    chat = client.chat.completions.create(
        model="llama",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=6,
        temperature=0,
        extra_headers={"traceparent": f"00-{trace_id}-b7ad6b7169203331-01"},
    )
    streamed = client.chat.completions.create(
        model="llama",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=6,
        temperature=0,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert chat.usage.completion_tokens == 6 and text == chat.choices[0].message.content
    spans = receiver.wait(lambda s: s.trace_id == trace_id, count=2)
    # A prompt this short goes to the decode pool alone (no PD legs): the router's span, then the
    # decode worker's, its child.
    router, decode = sorted(spans, key=lambda s: s.service, reverse=True)
    assert [(s.service, s.name, s.parent_span_id) for s in (router, decode)] == [
        ("ferry-router", "POST /v1/chat/completions", "b7ad6b7169203331"),
        ("ferry-decode", "llm_request", router.span_id),
    ]
    assert router.attributes["ferry.router.replica"] == argv["router"][argv["router"].index("--decode") + 1]
    assert decode.attributes["gen_ai.usage.completion_tokens"] == 6
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(60) == 0
    assert wait_gone(list(pids.values()), 60) == []


def test_worker_that_cannot_start_fails_the_start_and_leaves_nothing(tiny_llama: Path, start_up) -> None:
    up = start_up(
        f"""
model: {tiny_llama}
kv_tier: memory://
router: {{port: {free_port()}}}
mixed: {{replicas: 1, threads: 1, args: [--max-model-len, lots]}}
"""
    )
    assert up.proc.wait(120) == 1
    out = up.output()
    assert "[mixed-0] ferry serve: error: argument --max-model-len: invalid integer 'lots'" in out
    assert "[up] error: mixed-0 exited with exit code 2 before the cluster was ready" in out
    assert wait_gone(up.started_pids(), 60) == []
    assert len(up.started_pids()) == 2  # mixed-0 and the router


def test_children_die_with_a_killed_supervisor(tmp_path: Path) -> None:
    """PR_SET_PDEATHSIG: `ferry up` killed with SIGKILL (no chance to clean up) leaves no orphan."""
    script = (
        "import sys, time\n"
        "from ferry.cluster.child import Child, LogSink\n"
        "from ferry.cluster.plan import ProcessSpec\n"
        "spec = ProcessSpec('sleeper', 'worker', (sys.executable, '-c', 'import time; time.sleep(120)'), 1)\n"
        "child = Child(spec, LogSink(sys.stdout))\n"
        "child.start()\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        sleeper = int(parent.stdout.readline())
        assert alive(sleeper)
        parent.kill()
        parent.wait()
        assert wait_gone([sleeper], 60) == []
    finally:
        parent.kill()
