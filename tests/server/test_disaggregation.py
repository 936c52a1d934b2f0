"""The replica side of prefill/decode disaggregation, driven over HTTP as the router drives it.

A prefill replica answers ``kv_transfer: {"role": "producer"}`` with the prompt's block hashes
after writing the blocks to a shared Redis tier; a decode replica given the prompt, the first
token (``resume``) and ``kv_transfer: {"role": "consumer", ...}`` loads those blocks instead of
recomputing them and continues exactly where a single replica would have.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kvcache.keys import block_hashes, salt_extra, to_hex

PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    for name in sorted(os.listdir(argv[1])):\n        print(name)\n"


@pytest.fixture(scope="module")
def pd_pair(tiny_llama: Path, serve_logs: Path, server_process, redis_server):
    redis_server.flush()
    started = []
    try:
        for role in ("prefill", "decode"):
            flags = ["--role", role, "--kv-tier", redis_server.url, "--num-kv-blocks", "256"]
            started.append(server_process(tiny_llama, flags, serve_logs).start())
        yield started
    finally:
        for srv in started:
            srv.stop()


def _ids(choice: dict) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]


def test_prefill_then_decode_loads_blocks_and_matches_one_replica(pd_pair) -> None:
    prefill, decode = pd_pair
    prompt_ids = httpx.post(prefill.url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    common = {"temperature": 0, "logprobs": 0, "return_tokens_as_token_ids": True, "ignore_eos": True}

    first = httpx.post(
        prefill.url + "/v1/completions",
        timeout=60,
        json={"prompt": prompt_ids, "max_tokens": 1, "kv_transfer": {"role": "producer"}, **common},
    ).json()
    info = first["kv_transfer"]
    assert info["block_hashes"] == to_hex(block_hashes(prompt_ids, 16))
    assert info["tier_write_complete"] is True and info["tier_blocks"] == len(prompt_ids) // 16
    first_token = _ids(first["choices"][0])

    rest = httpx.post(
        decode.url + "/v1/completions",
        timeout=60,
        json={
            "prompt": prompt_ids,
            "max_tokens": 10,
            "resume": {"token_ids": first_token},
            "kv_transfer": {"role": "consumer", "block_hashes": info["block_hashes"]},
            **common,
        },
    ).json()
    # the decode replica never saw this prompt: every full prompt block came from the tier
    assert rest["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt_ids) // 16 * 16

    # a plain request to the decode worker is served whole there (the router's local-prefill path)
    alone = httpx.post(
        decode.url + "/v1/completions", timeout=60, json={"prompt": prompt_ids, "max_tokens": 10, **common}
    ).json()
    assert first_token + _ids(rest["choices"][0]) == _ids(alone["choices"][0])


def test_prefill_worker_answers_plain_requests_as_a_producer(pd_pair) -> None:
    prefill, _ = pd_pair
    r = httpx.post(
        prefill.url + "/v1/completions",
        timeout=60,
        json={
            "prompt": PROMPT,
            "max_tokens": 10,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    body = r.json()
    assert r.status_code == 200 and len(body["choices"][0]["token_ids"]) == 1
    assert body["usage"]["completion_tokens"] == 1 and body["choices"][0]["finish_reason"] == "length"
    assert body["kv_transfer"]["tier_write_complete"] is True
    # Nothing is held for a decode worker that may never come.
    metrics = httpx.get(prefill.url + "/metrics").text
    assert "vllm:kv_cache_usage_perc" in metrics
    assert any(
        line.startswith("vllm:kv_cache_usage_perc") and line.endswith(" 0.0") for line in metrics.splitlines()
    )


def test_roles_refuse_what_they_cannot_serve(pd_pair) -> None:
    prefill, decode = pd_pair
    prompt_ids = httpx.post(prefill.url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    consumer = {"role": "consumer", "block_hashes": to_hex(block_hashes(prompt_ids, 16))}
    r = httpx.post(prefill.url + "/v1/completions", json={"prompt": prompt_ids, "kv_transfer": consumer})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer.role"
    # hashes of another prompt: 400, never a silent recompute of the wrong thing
    other = to_hex(block_hashes(list(reversed(prompt_ids)), 16))
    r = httpx.post(
        decode.url + "/v1/completions",
        json={
            "prompt": prompt_ids,
            "resume": {"token_ids": [5]},
            "kv_transfer": {**consumer, "block_hashes": other},
        },
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "kv_transfer_mismatch"
    too_many = consumer["block_hashes"] + ["0" * 32]
    r = httpx.post(
        decode.url + "/v1/completions",
        json={"prompt": prompt_ids, "kv_transfer": {**consumer, "block_hashes": too_many}},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "kv_transfer_mismatch"
    # a prefix of the prompt's hashes is fine (the rest is computed)
    r = httpx.post(
        decode.url + "/v1/completions",
        json={
            "prompt": prompt_ids,
            "max_tokens": 2,
            "kv_transfer": {**consumer, "block_hashes": consumer["block_hashes"][:1]},
        },
    )
    assert r.status_code == 200


def test_role_is_reported(pd_pair) -> None:
    prefill, decode = pd_pair
    health = httpx.get(prefill.url + "/health").json()
    instance = health.pop("instance_id")
    assert health == {
        "status": "ok",
        "role": "prefill",
        "sleeping": False,
        "paused": False,
        "prefix_cache_resets": 0,
    }
    assert isinstance(instance, str) and len(instance) == 32
    assert httpx.get(decode.url + "/version").json()["role"] == "decode"


def test_reset_prefix_cache_drops_cached_blocks(pd_pair) -> None:
    _, decode = pd_pair
    r = httpx.post(
        decode.url + "/v1/completions", json={"prompt": PROMPT + " reset", "max_tokens": 2}, timeout=60
    )
    assert r.status_code == 200
    resets = httpx.get(decode.url + "/health").json()["prefix_cache_resets"]
    first = httpx.post(decode.url + "/reset_prefix_cache", timeout=10)
    assert first.status_code == 200 and first.json()["num_blocks_dropped"] >= 1
    assert httpx.post(decode.url + "/reset_prefix_cache", timeout=10).json()["num_blocks_dropped"] == 0
    # Each reset is counted in /health (a router's cue that the cache it knew of is gone).
    assert httpx.get(decode.url + "/health").json()["prefix_cache_resets"] == resets + 2


def test_chat_template_kwargs_and_tools_render_like_the_router(pd_pair, tiny_llama: Path) -> None:
    from router.prompt_keys import TokenKeyer

    prefill, _ = pd_pair
    body = {
        "messages": [{"role": "user", "content": "list the files"}],
        "tools": [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}],
        "tool_choice": "none",
        "chat_template_kwargs": {"enable_thinking": False},
        "max_tokens": 1,
    }
    r = httpx.post(prefill.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    hashes, tokens = TokenKeyer.from_dir(str(tiny_llama), 16).keys("/v1/chat/completions", body)
    assert r.json()["usage"]["prompt_tokens"] == tokens
    assert r.json()["kv_transfer"]["block_hashes"] == to_hex(hashes)
    # The request's own add_generation_prompt wins over its kwargs' (vLLM's merge), on both sides.
    merged = {**body, "chat_template_kwargs": {"enable_thinking": False, "add_generation_prompt": False}}
    r = httpx.post(prefill.url + "/v1/chat/completions", json=merged, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["kv_transfer"]["block_hashes"] == to_hex(hashes)
    assert TokenKeyer.from_dir(str(tiny_llama), 16).keys("/v1/chat/completions", merged) == (hashes, tokens)


def test_prefill_and_decode_roles_need_a_kv_tier(tiny_llama: Path) -> None:
    for role in ("prefill", "decode"):
        done = subprocess.run(
            [sys.executable, "-m", "ferry", "serve", "--model", str(tiny_llama), "--role", role],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2 and f"--role {role} needs a KV tier" in done.stderr


def test_a_salted_prompt_crosses_with_its_salt(pd_pair) -> None:
    """The producer's hashes carry the request's cache_salt; the consumer, given the same salt,
    finds every block; an unsalted request for the same prompt finds none of them."""
    prefill, decode = pd_pair
    prompt_ids = [
        t ^ 1 for t in httpx.post(prefill.url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    ]
    salt = {"cache_salt": "tenant-a", "temperature": 0, "ignore_eos": True}
    first = httpx.post(
        prefill.url + "/v1/completions",
        timeout=60,
        json={"prompt": prompt_ids, "max_tokens": 1, "kv_transfer": {"role": "producer"}, **salt},
    ).json()
    hashes = first["kv_transfer"]["block_hashes"]
    assert hashes == to_hex(block_hashes(prompt_ids, 16, salt_extra("tenant-a")))
    consumer = {"role": "consumer", "block_hashes": hashes}
    rest = httpx.post(
        decode.url + "/v1/completions",
        timeout=60,
        json={"prompt": prompt_ids, "max_tokens": 2, "kv_transfer": consumer, **salt},
    ).json()
    assert rest["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt_ids) // 16 * 16
    unsalted = httpx.post(
        decode.url + "/v1/completions", timeout=60, json={"prompt": prompt_ids[:-1], "max_tokens": 1}
    ).json()
    assert unsalted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
