"""`ferry up` over an existing KV tier that goes away after the cluster is up, and comes back on the
same port: the state file says so (``kv_tier_ok`` false, then true, ``ready`` true throughout), the
log says so once each way, and completions through the router are answered all along (the workers
recompute what they cannot load, and use the tier again once it is back). ``ferry up`` runs with
``--kv-tier-check-interval 0.2`` to keep it short."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest
import redis
from conftest import REPO, UpProcess, free_port, wait_gone

PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "import os\nimport sys\n\n\ndef main(argv):\n    for name in sorted(os.listdir(argv[1])):\n",
]


class UpWithFlags(UpProcess):
    """conftest's `ferry up` subprocess with more flags after ``--config`` and ``--state-file``."""

    def __init__(self, config: Path, state_file: Path, flags: list[str]) -> None:
        self.state_file = state_file
        self.lines: list[str] = []
        self._cond = threading.Condition()
        argv = [sys.executable, "-m", "ferry", "up", "--config", str(config), "--state-file", str(state_file)]
        self.proc = subprocess.Popen(
            [*argv, *flags],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=self._read, daemon=True).start()


@pytest.fixture
def start_up_with(tmp_path: Path):
    """``start(config_text, *flags)``: `ferry up` with these flags, stopped when the test ends."""
    started: list[UpProcess] = []

    def start(config_text: str, *flags: str) -> UpProcess:
        config = tmp_path / "cluster.yaml"
        config.write_text(config_text)
        up = UpWithFlags(config, tmp_path / "state.json", list(flags))
        started.append(up)
        return up

    yield start
    for up in started:
        up.kill()
        print(f"---- ferry up output ----\n{up.output()}")  # shown when the test fails


def wait_state(up, ok: bool, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = up.state()
        if state["kv_tier_ok"] is ok or time.monotonic() > deadline:
            return state
        time.sleep(0.05)


def wait_keys(tier: redis.Redis, timeout: float) -> list[bytes]:
    deadline = time.monotonic() + timeout
    while not (keys := tier.keys("ferry:kv:*")) and time.monotonic() < deadline:
        time.sleep(0.1)
    return keys


def test_a_kv_tier_that_goes_away_and_comes_back_is_followed(
    tiny_llama: Path, start_up_with, private_redis
) -> None:
    server = private_redis()
    url = server.url
    router_port = free_port()
    up = start_up_with(
        f"""
model: {tiny_llama}
kv_tier: {url}
router: {{port: {router_port}, policy: round_robin}}
mixed: {{replicas: 1, threads: 1}}
drain_timeout: 5
""",
        "--kv-tier-check-interval",
        "0.2",
    )
    up.wait_for(rf"^\[up\] ready: http://127\.0\.0\.1:{router_port} \(router; 1 mixed; KV tier ", 180)
    ready = up.state()
    assert (ready["ready"], ready["kv_tier"], ready["kv_tier_ok"], ready["kv_tier_error"]) == (
        True,
        url,
        True,
        None,
    )
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{router_port}/v1", api_key="none", max_retries=0)

    def complete(prompt: str) -> None:
        done = client.completions.create(
            model="llama", prompt=prompt, max_tokens=4, temperature=0, timeout=60
        )
        assert done.usage.completion_tokens == 4 and done.choices[0].finish_reason == "length"

    complete(PROMPTS[0])
    tier = redis.Redis.from_url(url, socket_timeout=5)
    assert wait_keys(tier, 10)  # the tier is in use

    server.stop()  # SIGKILL: the tier is gone
    away = wait_state(up, False, 20)
    assert away["kv_tier_ok"] is False and away["ready"] is True, away
    # The first PING that fails says what it met: the server gone (refused), or its socket closed
    # under the watch's open connection (a broken pipe, a reset, a close), by when it ran.
    gone = (
        rf"Error 111 connecting to 127\.0\.0\.1:{server.port}\. Connection refused"
        r"|Error 32 while writing to socket\. Broken pipe|Error 104 .*"
        r"|Connection closed by server\."
    )
    assert re.fullmatch(gone, away["kv_tier_error"]), away["kv_tier_error"]
    up.wait_for(
        rf"^\[up\] warning: cannot reach the KV tier {re.escape(url)}: (?:{gone}); the workers serve on,"
        r" recomputing what they would have loaded, until it answers again$",
        10,
    )
    for prompt in PROMPTS:  # served without the tier
        complete(prompt)

    server.start()  # the same port, empty
    back = wait_state(up, True, 20)
    assert back["kv_tier_ok"] is True and back["kv_tier_error"] is None and back["ready"] is True, back
    assert back["kv_tier_since"] > away["kv_tier_since"] > ready["kv_tier_since"]
    up.wait_for(rf"^\[up\] the KV tier {re.escape(url)} answers again \(after \d+\.\d s\)$", 10)
    # The workers use the tier again once their client tries it anew (a cool-down of about a second):
    # a new prompt's full blocks land in the fresh Redis (started empty). A new one each time: a
    # prompt the worker computed already sits in its own prefix cache and is not written again.
    deadline = time.monotonic() + 30
    attempt = 0
    while not tier.keys("ferry:kv:*") and time.monotonic() < deadline:
        complete(f"# attempt {attempt}\n{PROMPTS[0]}")
        attempt += 1
        time.sleep(0.5)
    assert tier.keys("ferry:kv:*")

    out = up.output().splitlines()
    assert len([line for line in out if line.startswith("[up] warning: cannot reach the KV tier")]) == 1
    assert len([line for line in out if line.startswith("[up] the KV tier ")]) == 1
    pids = list(up.pids().values())
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(60) == 0
    assert wait_gone(pids, 60) == []
