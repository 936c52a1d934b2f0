"""A Redis that will not run Lua scripts still serves the tier: lookups fall back to ``EXISTS``.

Two real ways a server refuses ``EVALSHA``: an ACL user without the scripting commands (redis-py
raises ``NoPermissionError``: "no permissions to run the 'evalsha' command"), and the commands
renamed away, as some managed Redis do ("unknown command 'EVALSHA'"). Either way a lookup must
answer from the keys, not count a refusal and report 0 blocks forever (no tier hit ever).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from kvcache.tier import open_tier
from tests.conftest import free_port

KEYS = ["ferry:kv:fp:a", "ferry:kv:fp:b", "ferry:kv:fp:c"]


def _restricted_user_url(server) -> str:
    admin = redis.Redis(port=server.port)
    admin.execute_command(
        "ACL",
        "SETUSER",
        "ferry",
        "on",
        ">secret",
        "~ferry:*",
        "+@read",
        "+@write",
        "+@connection",
        "-@scripting",
    )
    return f"redis://ferry:secret@127.0.0.1:{server.port}/0"


@pytest.fixture
def scriptless_redis(tmp_path: Path) -> Iterator[str]:
    """A private redis-server with EVAL and EVALSHA renamed away."""
    port = free_port()
    proc = subprocess.Popen(
        [
            shutil.which("redis-server") or "redis-server",
            "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(tmp_path), "--protected-mode", "no",
            "--rename-command", "EVALSHA", "", "--rename-command", "EVAL", "",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait()


def _check_lookups(url: str) -> None:
    tier = open_tier(url)
    try:
        assert tier.put_many([(KEYS[0], b"1"), (KEYS[1], b"2")]) == [True, True]
        assert tier.contains_prefix(KEYS) == 2
        assert tier.contains_prefix_many([KEYS[:1], KEYS[1:], KEYS]) == [1, 1, 2]
        assert tier.stats().errors == {}
    finally:
        tier.close()


def test_acl_user_without_scripting(private_redis) -> None:
    _check_lookups(_restricted_user_url(private_redis()))


def test_scripting_commands_renamed_away(scriptless_redis: str) -> None:
    _check_lookups(scriptless_redis)


def test_engine_loads_through_an_acl_user_without_scripting(tiny_llama, private_redis) -> None:
    url = _restricted_user_url(private_redis())
    prompt = [(5 * i + 1) % 900 + 10 for i in range(5 * 16)]
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    options = {"block_size": 16, "num_kv_blocks": 64, "deterministic": True}
    cold = LLM(str(tiny_llama), **options).generate([prompt], greedy)[0].outputs[0].token_ids
    writer = LLM(str(tiny_llama), kv_tier=url, **options)
    writer.generate([prompt], greedy)
    assert writer.engine.connector.flush(10.0)
    out = LLM(str(tiny_llama), kv_tier=url, **options).generate([prompt], greedy)[0]
    assert out.outputs[0].token_ids == cold
    assert out.num_cached_tokens == 4 * 16  # every loadable block came from the tier
