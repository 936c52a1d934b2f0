"""vLLM's `cache_salt`: a request reuses cached prompt blocks only from requests with the same salt
(its block hashes are salted), on completions and chat; a bad salt is a 400. Collected against the
`--api-server-count 2` replica too (tests/server/test_api_servers.py)."""

from __future__ import annotations

import random

import httpx

# 40 tokens (2 full blocks of 16) no other test sends.
PROMPT = random.Random(4242).sample(range(3, 1000), 40)


def _cached(server, prompt: list[int], **extra) -> int:
    body = {"model": server.model_name, "prompt": prompt, "max_tokens": 1, **extra}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_blocks_are_reused_only_under_the_same_salt(server) -> None:
    prompt = PROMPT[:-1] + [PROMPT[-1] ^ 1]  # its own prompt in each server this runs against
    assert _cached(server, prompt, cache_salt="tenant-a") == 0
    assert _cached(server, prompt, cache_salt="tenant-b") == 0
    assert _cached(server, prompt) == 0  # the salted blocks are no one else's
    assert _cached(server, prompt, cache_salt="tenant-a") == 32
    assert _cached(server, prompt, cache_salt="tenant-b") == 32
    assert _cached(server, prompt) == 32
    chat = {
        "model": server.model_name,
        "messages": [{"role": "user", "content": " ".join(str(t) for t in PROMPT)}],
        "max_tokens": 1,
    }
    cached = []
    for salt in ("tenant-a", "tenant-b", "tenant-a"):
        r = httpx.post(server.url + "/v1/chat/completions", json={**chat, "cache_salt": salt}, timeout=60)
        cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert cached[0] == cached[1] == 0 and cached[2] > 0


def test_bad_salts_are_400s(server) -> None:
    for salt in ("", 5, ["a"], "s" * 4097):
        body = {"model": server.model_name, "prompt": "x", "max_tokens": 1, "cache_salt": salt}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
