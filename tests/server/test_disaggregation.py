"""The replica side of prefill/decode disaggregation, driven over HTTP as the router drives it.

A prefill replica answers ``kv_transfer: {"role": "producer"}`` with the prompt's block hashes
after writing the blocks to a shared Redis tier; a decode replica given the prompt, the first
token (``resume``) and ``kv_transfer: {"role": "consumer", ...}`` loads those blocks instead of
recomputing them and continues exactly where a single replica would have.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from kvcache.keys import block_hashes, to_hex

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
