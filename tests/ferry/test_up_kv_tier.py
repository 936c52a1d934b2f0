"""`ferry up` with an existing KV tier (``kv_tier: redis://…``): one that does not answer stops the
start before anything runs, saying so (exit 1, as any other part that cannot start), instead of a
cluster announced ready whose workers quietly miss on every block; one that answers is used."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import openai
import redis
from conftest import free_port, wait_gone

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci("
ADVICE = (
    ". Start that Redis or fix the URL (host, port, password, TLS), or leave kv_tier out and ferry up"
    " starts a redis-server of its own."
)


def test_a_kv_tier_nobody_listens_on_stops_the_start(tiny_llama: Path, start_up) -> None:
    port = free_port()  # closed again: nothing listens there
    up = start_up(
        f"""
model: {tiny_llama}
kv_tier: redis://ferry:s3cret@127.0.0.1:{port}/0
router: {{port: {free_port()}}}
mixed: {{replicas: 1, threads: 1}}
"""
    )
    assert up.proc.wait(60) == 1
    out = up.output()
    assert out == (
        f"ferry up: kv_tier: cannot reach the KV tier redis://ferry:***@127.0.0.1:{port}/0: Error 111"
        f" connecting to 127.0.0.1:{port}. Connection refused" + ADVICE
    )
    assert up.started_pids() == [] and not up.state_file.exists()


def test_a_kv_tier_that_refuses_the_password_stops_the_start(start_up, private_redis) -> None:
    tier = private_redis(password="right")
    up = start_up(f"kv_tier: redis://:wrong@127.0.0.1:{tier.port}/0\nmixed: {{replicas: 1}}\n")
    assert up.proc.wait(60) == 1
    out = up.output()
    assert out.startswith(
        f"ferry up: kv_tier: cannot log in to the KV tier redis://:***@127.0.0.1:{tier.port}/0: "
    ), out
    assert out.endswith(ADVICE) and "wrong" not in out
    assert up.started_pids() == []


def test_a_kv_tier_that_answers_is_the_cluster_s(tiny_llama: Path, start_up, redis_url: str) -> None:
    router_port = free_port()
    up = start_up(
        f"""
model: {tiny_llama}
kv_tier: {redis_url}
router: {{port: {router_port}, policy: round_robin}}
mixed: {{replicas: 1, threads: 1}}
drain_timeout: 5
"""
    )
    up.wait_for(
        rf"^\[up\] ready: http://127\.0\.0\.1:{router_port} \(router; 1 mixed; KV tier {redis_url}\)$", 180
    )
    assert up.state()["ready"] is True and up.state()["kv_tier"] == redis_url
    assert sorted(up.pids()) == ["mixed-0", "router"]  # no Redis of its own
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{router_port}/v1", api_key="none", max_retries=0)
    done = client.completions.create(model="llama", prompt=PROMPT, max_tokens=2, temperature=0)
    assert done.usage.completion_tokens == 2
    tier = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + 60
    while not tier.keys("ferry:kv:*") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert tier.keys("ferry:kv:*")  # the prompt's full blocks went to the user's Redis
    pids = list(up.pids().values())
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(60) == 0
    assert wait_gone(pids, 60) == []
