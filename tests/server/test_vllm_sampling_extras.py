"""vLLM's sampling extras over HTTP: ``allowed_token_ids``, ``bad_words``, ``truncate_prompt_tokens``,
each checked against what the request would give without it."""

from __future__ import annotations

import httpx
import pytest

PROMPT = "def parse_args(argv):\n    parser = argparse.ArgumentParser()\n    parser.add_argument("


def _complete(server, **body) -> dict:
    r = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "return_token_ids": True, **body},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_allowed_token_ids(server) -> None:
    plain = _complete(server)["choices"][0]["token_ids"]
    allowed = sorted(set(plain[1:5]) | {11, 12, 13})  # not the greedy first token
    assert plain[0] not in allowed
    got = _complete(server, allowed_token_ids=allowed, ignore_eos=True)["choices"][0]["token_ids"]
    assert len(got) == 16 and set(got) <= set(allowed)


def test_bad_words_are_never_completed(server, tokenizer) -> None:
    plain = _complete(server, ignore_eos=True)["choices"][0]
    # A word the greedy model writes: banned, it must not appear again (alone or after a space).
    word = plain["text"].split()[0]
    got = _complete(server, ignore_eos=True, bad_words=[word])["choices"][0]
    banned = [tokenizer.encode(w, add_special_tokens=False) for w in (word, " " + word)]
    ids = got["token_ids"]
    for seq in banned:
        assert not any(ids[i : i + len(seq)] == seq for i in range(len(ids) - len(seq) + 1))
    assert ids != plain["token_ids"]


def test_truncate_prompt_tokens_keeps_the_prompts_end(server, tokenizer) -> None:
    ids = tokenizer.encode(PROMPT)
    got = _complete(server, truncate_prompt_tokens=5)
    assert got["usage"]["prompt_tokens"] == 5
    assert got["choices"][0]["token_ids"] == _complete(server, prompt=ids[-5:])["choices"][0]["token_ids"]
    chat = httpx.post(
        server.url + "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 1,
            "truncate_prompt_tokens": 7,
        },
        timeout=60,
    ).json()
    assert chat["usage"]["prompt_tokens"] == 7


def test_truncation_side_right_keeps_the_prompts_start(server, tokenizer) -> None:
    """vLLM's ``truncation_side: "right"``: the prompt's first N tokens, a completion's and a chat's."""
    ids = tokenizer.encode(PROMPT)
    got = _complete(server, truncate_prompt_tokens=5, truncation_side="right")["choices"][0]["token_ids"]
    assert got == _complete(server, prompt=ids[:5])["choices"][0]["token_ids"]
    messages = [{"role": "user", "content": PROMPT}]
    chat_ids = httpx.post(server.url + "/tokenize", json={"messages": messages}, timeout=60).json()["tokens"]
    body = {"messages": messages, "max_tokens": 16, "temperature": 0, "return_token_ids": True}
    chat = httpx.post(
        server.url + "/v1/chat/completions",
        json={**body, "truncate_prompt_tokens": 9, "truncation_side": "right"},
        timeout=60,
    ).json()
    assert chat["usage"]["prompt_tokens"] == 9
    assert (
        chat["choices"][0]["token_ids"] == _complete(server, prompt=chat_ids[:9])["choices"][0]["token_ids"]
    )


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [100000]}, "allowed_token_ids"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": 2, "truncation_side": "middle"}, "truncation_side"),
        ({"bad_words": "x"}, "bad_words"),
    ],
)
def test_bad_values_are_400s(server, extra, param) -> None:
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1, **extra}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_allowed_ids_that_are_all_bad_words_are_a_400(server, tokenizer) -> None:
    (tid,) = tokenizer.encode("def", add_special_tokens=False)
    body = {"prompt": "x", "max_tokens": 1, "allowed_token_ids": [tid], "bad_words": ["def"], "stream": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words", r.text
