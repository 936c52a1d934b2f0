"""vLLM's sampling extras over HTTP: ``allowed_token_ids``, ``bad_words``, ``truncate_prompt_tokens``,
each checked against what the request would give without it; and the prompt an answer shows back
(``return_token_ids``' ``prompt_token_ids``, ``return_prompt_text``), checked against /tokenize, the
render route and the model's own HF tokenizer."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from transformers import PreTrainedTokenizerFast

PROMPT = "def parse_args(argv):\n    parser = argparse.ArgumentParser()\n    parser.add_argument("
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
IDS = {"return_token_ids": True}


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


def _prompt_fields(obj) -> dict:
    """The prompt fields an SDK object (answer, chunk or choice) carries, by name."""
    return {k: v for k, v in (obj.model_extra or {}).items() if k in ("prompt_token_ids", "prompt_text")}


def test_chat_prompt_token_ids_and_prompt_text(server, client, tiny_llama: Path) -> None:
    """vLLM's ``prompt_token_ids`` (with ``return_token_ids``) and ``prompt_text``: the rendered
    prompt, on a whole answer's top level and on each choice's role chunk of a stream, only."""
    ids = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}, timeout=60).json()["tokens"]
    rendered = httpx.post(server.url + "/v1/chat/completions/render", json={"messages": MESSAGES}, timeout=60)
    assert rendered.json()["token_ids"] == ids
    text = PreTrainedTokenizerFast.from_pretrained(tiny_llama).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\nYou are terse.")
    both = {**IDS, "return_prompt_text": True}
    kw = dict(messages=MESSAGES, model=None, max_tokens=3, temperature=0, n=2)
    whole = client.chat.completions.create(**kw, extra_body=both)
    assert _prompt_fields(whole) == {"prompt_token_ids": ids, "prompt_text": text}
    assert [len(c.model_extra["token_ids"]) for c in whole.choices] == [3, 3]
    only_ids = client.chat.completions.create(**kw, extra_body=IDS)
    assert _prompt_fields(only_ids) == {"prompt_token_ids": ids}
    only_text = client.chat.completions.create(**kw, extra_body={"return_prompt_text": True})
    assert _prompt_fields(only_text) == {"prompt_text": text}
    raw = httpx.post(server.url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2}).json()
    assert "prompt_token_ids" not in raw and "prompt_text" not in raw and "token_ids" not in raw["choices"][0]

    chunks = list(client.chat.completions.create(**kw, stream=True, extra_body=both))
    carrying = [c for c in chunks if _prompt_fields(c)]
    assert [c.choices[0].index for c in carrying] == [0, 1]
    for c in carrying:
        assert c.choices[0].delta.role == "assistant"
        assert _prompt_fields(c) == {"prompt_token_ids": ids, "prompt_text": text}
    # Each choice's first chunk is its role chunk, the one carrying the prompt.
    firsts = {}
    for c in chunks:
        for choice in c.choices:
            firsts.setdefault(choice.index, c)
    assert [firsts[0], firsts[1]] == carrying
    plain = list(client.chat.completions.create(**kw, stream=True))
    assert not any(_prompt_fields(c) for c in plain)


def test_completion_prompt_token_ids_per_prompt(server, client) -> None:
    """Completions: each choice carries its own prompt's ids (a whole answer), or on its first chunk
    only (a stream); echo keeps the echoed text (vLLM drops it with return_token_ids: not here)."""
    prompts = [PROMPT, "import os\nimport sys\n"]
    ids = [
        httpx.post(server.url + "/tokenize", json={"prompt": p}, timeout=60).json()["tokens"] for p in prompts
    ]
    assert ids[0] != ids[1]
    kw = dict(prompt=prompts, model=None, max_tokens=3, temperature=0, n=2)
    whole = client.completions.create(**kw, extra_body=IDS)
    assert [c.model_extra["prompt_token_ids"] for c in whole.choices] == [ids[0], ids[0], ids[1], ids[1]]
    echoed = client.completions.create(**{**kw, "prompt": prompts[1]}, echo=True, extra_body=IDS)
    assert echoed.choices[0].text.startswith(prompts[1]) and len(echoed.choices[0].text) > len(prompts[1])
    assert echoed.choices[0].model_extra["prompt_token_ids"] == ids[1]
    plain = client.completions.create(**kw)
    assert not any(_prompt_fields(c) for c in plain.choices)

    chunks = list(client.completions.create(**{**kw, "max_tokens": 12}, stream=True, extra_body=IDS))
    seen: dict[int, list] = {}
    for c in chunks:
        for choice in c.choices:
            seen.setdefault(choice.index, []).append(choice.model_extra.get("prompt_token_ids"))
    assert sorted(seen) == [0, 1, 2, 3]
    # (A loaded server may fold a choice's tokens into fewer chunks: those after its first, if any,
    # carry no prompt ids; of four choices of 12 tokens, some have more than one chunk.)
    assert any(len(fields) > 1 for fields in seen.values())
    for index, fields in seen.items():
        assert fields[0] == ids[index // 2] and not any(fields[1:])
    assert not any(
        _prompt_fields(ch) for c in client.completions.create(**kw, stream=True) for ch in c.choices
    )
