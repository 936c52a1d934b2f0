"""`ferry up` end to end with a hung replica: its one `ferry serve` worker (a tiny model) is stopped
with SIGSTOP, so its port still accepts connections but nothing answers. The liveness probes
(``liveness: {interval: 0.2, timeout: 2, failure_threshold: 3}``) find it hung, ferry up says so once,
kills it (SIGTERM, then SIGKILL: a stopped process acts only on the second) and restarts it on the
same port; the router takes the new process back and the cluster answers as before."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import openai
from conftest import alive, free_port, wait_gone

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci("


def complete_when_served(client: openai.OpenAI, timeout: float) -> str:
    """The completion's text once the router has a worker to send it to (it retries nothing)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return (
                client.completions.create(model="llama", prompt=PROMPT, max_tokens=8, temperature=0)
                .choices[0]
                .text
            )
        except openai.APIStatusError as e:
            assert e.status_code == 503 and time.monotonic() < deadline, e
            time.sleep(0.2)


def test_up_kills_and_restarts_a_stopped_replica(tiny_llama: Path, start_up) -> None:
    router_port = free_port()
    up = start_up(
        f"""
model: {tiny_llama}
router: {{port: {router_port}, policy: round_robin, args: [--health-interval, "0.5"]}}
mixed: {{replicas: 1, threads: 1}}
kv_tier: memory://
drain_timeout: 5
restart: {{initial_delay: 0.5}}
liveness: {{interval: 0.2, timeout: 2, failure_threshold: 3}}
"""
    )
    up.wait_for(r"^\[up\] ready: http://127\.0\.0\.1:\d+ \(router; 1 mixed; KV tier memory://\)", 180)
    state = up.state()
    assert state["liveness"] == {
        "interval": 0.2,
        "timeout": 2.0,
        "failure_threshold": 3,
        "termination_grace_period": 5.0,
    }
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{router_port}/v1", api_key="none", max_retries=0)
    before = complete_when_served(client, 30)
    victim = up.pids()["mixed-0"]

    mark = len(up.lines)
    os.kill(victim, signal.SIGSTOP)
    hung = up.wait_for(
        rf"^\[up\] mixed-0 \(pid {victim}\) runs but answered none of the last 3 /health probes.*", 60, mark
    )
    assert hung.group(0).endswith(": hung; SIGTERM, then SIGKILL in 5 s, to restart it"), hung.group(0)
    up.wait_for(
        rf"^\[up\] mixed-0 \(pid {victim}\) exited with signal SIGKILL; restarting in 0\.5 s$", 30, mark
    )
    new_pid = int(up.wait_for(r"^\[up\] mixed-0 is healthy again \(pid (\d+)\)", 120, mark).group(1))
    assert new_pid != victim and not alive(victim)
    worker = next(p for p in up.state()["processes"] if p["name"] == "mixed-0")
    assert worker["pids"] == [victim, new_pid] and worker["restarts"] == 1 and worker["hung_kills"] == 1
    assert complete_when_served(client, 60) == before
    assert sum("hung" in line for line in up.lines[mark:]) == 1, up.output()

    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(60) == 0
    assert wait_gone([*up.started_pids()], 60) == []
