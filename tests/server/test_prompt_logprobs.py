"""vLLM's ``prompt_logprobs`` over HTTP: per prompt position the prompt token's logprob, rank and
text plus the top-N, equal to the offline engine's; the same on a repeat (a prefix-cache hit must
not skip the prompt's logits); chat carries them at the response level; not with stream."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from engine import LLM, SamplingParams
from engine.tokenizer import Tokenizer

PROMPT = "def parse_args(argv):\n    parser = argparse.ArgumentParser()"


@pytest.fixture(scope="module")
def reference(tiny_llama: Path):
    llm = LLM(str(tiny_llama), num_kv_blocks=64, num_threads=1)
    try:
        out = llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=3))[0]
    finally:
        llm.close()
    return out


def _check(entries, reference, tokenizer: Tokenizer) -> None:
    ids = reference.prompt_token_ids
    assert len(entries) == len(ids) and entries[0] is None
    for pos, (entry, ref) in enumerate(zip(entries[1:], reference.prompt_logprobs[1:], strict=True), start=1):
        got = {int(k): v for k, v in entry.items()}
        assert ids[pos] in got and len(got) <= 4  # the prompt token, plus the top 3
        assert sorted(r["rank"] for r in got.values())[:3] == [1, 2, 3]
        assert set(got) == set(ref)
        for tid, value in got.items():
            assert value["logprob"] == pytest.approx(ref[tid].logprob, abs=1e-4)
            assert value["rank"] == ref[tid].rank
            assert value["decoded_token"] == tokenizer.token_text(tid)


def test_completions_prompt_logprobs_equal_the_engine(server, reference, tiny_llama) -> None:
    body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 3}
    tokenizer = Tokenizer.from_dir(tiny_llama)
    first = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    _check(first["choices"][0]["prompt_logprobs"], reference, tokenizer)
    again = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()  # prefix now cached
    assert again["choices"][0]["prompt_logprobs"] == first["choices"][0]["prompt_logprobs"]
    plain = httpx.post(
        server.url + "/v1/completions", json={**body, "prompt_logprobs": None}, timeout=60
    ).json()
    assert "prompt_logprobs" not in plain["choices"][0]


def test_echo_keeps_its_own_top_n(server) -> None:
    body = {
        "prompt": PROMPT,
        "max_tokens": 1,
        "temperature": 0,
        "echo": True,
        "logprobs": 1,
        "prompt_logprobs": 3,
    }
    choice = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    echoed = choice["logprobs"]["top_logprobs"]
    assert all(len(top) <= 2 for top in echoed[1:])  # 1 asked for, plus the token itself
    assert max(len(e) for e in choice["prompt_logprobs"][1:]) == 4


def test_chat_prompt_logprobs_at_the_response_level(server) -> None:
    body = {"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 1, "prompt_logprobs": 0}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    entries = r["prompt_logprobs"]
    assert len(entries) == r["usage"]["prompt_tokens"] and entries[0] is None
    assert all(len(e) == 1 for e in entries[1:])  # top 0: only the prompt's own token


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_not_with_stream_and_bounded(server, path) -> None:
    base = (
        {"prompt": "x"}
        if path.endswith("/completions") and "chat" not in path
        else {"messages": [{"role": "user", "content": "x"}]}
    )
    for extra in ({"stream": True, "prompt_logprobs": 1}, {"prompt_logprobs": 21}, {"prompt_logprobs": -1}):
        r = httpx.post(server.url + path, json={**base, "max_tokens": 1, **extra}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_zero_with_stream_is_taken_as_vllm_takes_it(server, path) -> None:
    """``prompt_logprobs: 0`` asks for no alternatives: vLLM takes it with ``stream`` (and a stream
    has no place for prompt logprobs), so it streams as without it."""
    chat = "chat" in path
    base = {"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"}
    base = {**base, "max_tokens": 3, "temperature": 0, "stream": True}
    texts = []
    for extra in ({"prompt_logprobs": 0}, {}):
        with httpx.stream("POST", server.url + path, json={**base, **extra}, timeout=60) as r:
            assert r.status_code == 200
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert not any("prompt_logprobs" in e for e in events)
        texts.append(
            "".join(
                c["delta"].get("content") or "" if chat else c["text"] for e in events for c in e["choices"]
            )
        )
    assert texts[0] == texts[1]
