"""vLLM's sampling extras over HTTP: ``allowed_token_ids``, ``bad_words``, ``truncate_prompt_tokens``,
each checked against what the request would give without it; and the prompt an answer shows back
(``return_token_ids``' ``prompt_token_ids``, ``return_prompt_text``), checked against /tokenize, the
render route and the model's own HF tokenizer."""

from __future__ import annotations

import json
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


def _first_repeat(ids: list[int], lo: int, hi: int, count: int) -> int | None:
    """Independent reference: the fewest leading tokens of ``ids`` that end in one N-gram of ``lo`` ..
    ``hi`` tokens written ``count`` times back to back."""
    for end in range(1, len(ids) + 1):
        for size in range(lo, min(hi, end // count) + 1):
            copies = {tuple(ids[end - size * (k + 1) : end - size * k]) for k in range(count)}
            if len(copies) == 1:
                return end
    return None


REPEATS = "repetition_detected"


@pytest.mark.parametrize(
    ("rule", "lo"),
    [
        ({"max_pattern_size": 4, "min_pattern_size": 0, "min_count": 3}, 1),  # min 0 means 1
        ({"max_pattern_size": 8, "min_pattern_size": 4, "min_count": 2}, 4),  # short loops too small
    ],
)
def test_repetition_detection_stops_where_the_loop_completes(server, rule, lo) -> None:
    """vLLM's ``repetition_detection``: the greedy run stops at the first token where its tail is one
    N-gram repeated ``min_count`` times (checked against the whole run), finish_reason "stop" with
    stop reason "repetition_detected", whole and streamed."""
    full = _complete(server, ignore_eos=True, max_tokens=96)["choices"][0]["token_ids"]
    end = _first_repeat(full, lo, rule["max_pattern_size"], rule["min_count"])
    assert end is not None and end < 96, full  # this tiny model loops early (a 3-token loop at 14)
    got = _complete(server, ignore_eos=True, max_tokens=96, repetition_detection=rule)["choices"][0]
    assert got["token_ids"] == full[:end]
    assert (got["finish_reason"], got["stop_reason"]) == ("stop", REPEATS)
    # A length cap reached on that very token wins, as in vLLM.
    capped = _complete(server, ignore_eos=True, max_tokens=end, repetition_detection=rule)["choices"][0]
    assert (capped["finish_reason"], capped["stop_reason"]) == ("length", None)
    # The token that completes the loop is output with its text, as vLLM's (only an EOS or a stop
    # id ends a request textless): the same tokens, the same text.
    assert got["text"] == capped["text"]
    body = {"prompt": PROMPT, "max_tokens": 96, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST", server.url + "/v1/completions", json={**body, **IDS, "repetition_detection": rule}, timeout=60
    ) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"] or []] == full[:end]
    assert "".join(c["choices"][0]["text"] for c in chunks) == capped["text"]
    assert (chunks[-1]["choices"][0]["finish_reason"], chunks[-1]["choices"][0]["stop_reason"]) == (
        "stop",
        REPEATS,
    )


def test_repetition_detection_on_chat_and_generate(server) -> None:
    """The same check on chat, and on ``/inference/v1/generate`` from what render answers (which
    carries the rule in vLLM's ``sampling_params`` names)."""
    rule = {"max_pattern_size": 8, "min_count": 2}
    body = {"messages": MESSAGES, "max_tokens": 128, "temperature": 0, "ignore_eos": True, **IDS}
    url = server.url + "/v1/chat/completions"
    full = httpx.post(url, json=body, timeout=60).json()["choices"][0]["token_ids"]
    end = _first_repeat(full, 1, 8, 2)
    assert end is not None and end < 128, full  # a 7-token loop written twice by token 96
    got = httpx.post(url, json={**body, "repetition_detection": rule}, timeout=60).json()["choices"][0]
    assert got["token_ids"] == full[:end]
    assert (got["finish_reason"], got["stop_reason"]) == ("stop", REPEATS)
    capped = httpx.post(url, json={**body, "max_tokens": end}, timeout=60).json()["choices"][0]
    assert got["message"]["content"] == capped["message"]["content"]  # the last token's text too

    rule = {"max_pattern_size": 4, "min_pattern_size": 1, "min_count": 3}
    plain = _complete(server, ignore_eos=True, max_tokens=96)["choices"][0]["token_ids"]
    render = {"prompt": PROMPT, "max_tokens": 96, "temperature": 0, "ignore_eos": True}
    [req] = httpx.post(
        server.url + "/v1/completions/render", json={**render, "repetition_detection": rule}, timeout=60
    ).json()
    assert req["sampling_params"]["repetition_detection"] == rule
    out = httpx.post(server.url + "/inference/v1/generate", json=req, timeout=60).json()["choices"][0]
    assert out["token_ids"] == plain[: _first_repeat(plain, 1, 4, 3)]
    assert out["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("rule", "words"),
    [
        ({"max_pattern_size": 2, "min_pattern_size": 3, "min_count": 2}, "must not exceed"),
        ({"max_pattern_size": 4, "min_count": 1}, "min_count must be at least 2"),
        ({"max_pattern_size": -1, "min_count": 2}, "greater than or equal to 0"),
        ({"max_pattern_size": 5000, "min_count": 2}, "at most 1024"),
        ({"max_pattern_size": 4, "min_count": "3"}, "valid integer"),
    ],
)
def test_repetition_detection_bad_values_are_400s(server, rule, words) -> None:
    for path, body in (
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": MESSAGES}),
    ):
        r = httpx.post(
            server.url + path, json={**body, "max_tokens": 1, "repetition_detection": rule}, timeout=60
        )
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"].startswith("repetition_detection") and words in error["message"], error


def _by_id(entries: list[dict]) -> dict[int, float]:
    return {int(e["token"].removeprefix("token_id:")): e["logprob"] for e in entries}


def test_logprob_token_ids_are_the_top_20_values(server) -> None:
    """vLLM's ``logprob_token_ids``: at each position the sampled token, then exactly the named ids
    in their order, each with the logprob a ``top_logprobs: 20`` run of the same greedy output shows
    (an id outside that run's top 20 is below its 20th value); on chat, completions and generate."""
    url = server.url + "/v1/chat/completions"
    body = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0, "logprobs": True}
    body |= {"return_tokens_as_token_ids": True, **IDS}
    # Each run with its own cache salt computes its prompt afresh: a prefix-cache hit would compute
    # the same values another way (rounding apart), and the values are compared exactly.
    wide = httpx.post(url, json={**body, "top_logprobs": 20, "cache_salt": "a"}, timeout=60).json()
    wide = wide["choices"][0]
    first = _by_id(wide["logprobs"]["content"][0]["top_logprobs"])
    ranked = sorted(first, key=lambda t: -first[t])
    named = [ranked[12], ranked[3], 999, ranked[0]]  # out of natural order; 999: a rare id
    got = httpx.post(
        url, json={**body, "top_logprobs": 2, "logprob_token_ids": named, "cache_salt": "b"}, timeout=60
    ).json()
    got = got["choices"][0]
    assert got["token_ids"] == wide["token_ids"]
    for token_id, full, part in zip(
        got["token_ids"], wide["logprobs"]["content"], got["logprobs"]["content"], strict=True
    ):
        shown = [int(e["token"].removeprefix("token_id:")) for e in part["top_logprobs"]]
        assert shown == [token_id] + [t for t in named if t != token_id]  # top_logprobs: 2 is ignored
        values, top20 = _by_id(part["top_logprobs"]), _by_id(full["top_logprobs"])
        for t in shown:
            if t in top20:
                assert values[t] == top20[t]
            else:
                assert values[t] < min(top20.values())
        assert part["logprob"] == full["logprob"]

    plain = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "return_tokens_as_token_ids": True}
    wide = _complete(server, **plain, logprobs=20, cache_salt="c")["choices"][0]["logprobs"]["top_logprobs"]
    got = _complete(server, **plain, logprobs=1, logprob_token_ids=named, cache_salt="d")
    got = got["choices"][0]["logprobs"]
    for sampled, part, full in zip(got["tokens"], got["top_logprobs"], wide, strict=True):
        assert list(part) == [sampled] + [f"token_id:{t}" for t in named if f"token_id:{t}" != sampled]
        assert all(part[k] == full[k] for k in part if k in full)

    [req] = httpx.post(
        server.url + "/v1/completions/render", json={**plain, "logprobs": 1}, timeout=60
    ).json()
    req["sampling_params"]["logprob_token_ids"] = named
    out = httpx.post(server.url + "/inference/v1/generate", json=req, timeout=60).json()["choices"][0]
    for part, full in zip(out["logprobs"]["content"], wide, strict=True):
        values = _by_id(part["top_logprobs"])
        assert list(values) == [int(part["token"][9:])] + [
            t for t in named if f"token_id:{t}" != part["token"]
        ]
        assert all(v == full[f"token_id:{t}"] for t, v in values.items() if f"token_id:{t}" in full)


@pytest.mark.parametrize(
    ("path", "extra", "words"),
    [
        ("/v1/chat/completions", {"logprob_token_ids": [5]}, "logprobs must be true"),
        ("/v1/chat/completions", {"logprobs": True, "logprob_token_ids": []}, "at least 1"),
        ("/v1/chat/completions", {"logprobs": True, "logprob_token_ids": [100000]}, "out of range"),
        ("/v1/completions", {"logprob_token_ids": [5]}, "needs logprobs"),
        ("/v1/completions", {"logprobs": 1, "logprob_token_ids": [-1]}, "out of range"),
        (
            "/v1/completions",
            {"logprobs": 1, "logprob_token_ids": [5], "use_beam_search": True, "n": 2},
            "beam",
        ),
    ],
)
def test_logprob_token_ids_bad_values_are_400s(server, path, extra, words) -> None:
    body = {"messages": MESSAGES} if "chat" in path else {"prompt": "x"}
    r = httpx.post(server.url + path, json={**body, "max_tokens": 1, **extra}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "logprob_token_ids" and words in error["message"], error


def _stream_sizes(server, path: str, body: dict) -> tuple[list[int], list[int]]:
    """A stream's chunks' token counts (those that carry tokens) and all its token ids."""
    with httpx.stream("POST", server.url + path, json={**body, "stream": True, **IDS}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    ids = [c["choices"][0].get("token_ids") or [] for c in chunks if c["choices"]]
    sizes = [len(t) for t in ids if t]
    return sizes, [t for part in ids for t in part]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_interval_batches_tokens(server, path) -> None:
    """vLLM's ``stream_interval``: after the first chunk (sent at once), every chunk but the last
    holds at least N tokens, and the tokens are the plain stream's (whose chunks, read about as fast
    as the model writes them, hold one token or a few: more only when the server is loaded, so their
    sizes are not asserted)."""
    body = {"max_tokens": 14, "temperature": 0, "ignore_eos": True}
    body |= {"messages": MESSAGES} if "chat" in path else {"prompt": PROMPT}
    plain_sizes, plain = _stream_sizes(server, path, body)
    sizes, ids = _stream_sizes(server, path, {**body, "stream_interval": 4})
    assert len(plain) == 14, plain_sizes
    assert ids == plain
    assert all(n >= 4 for n in sizes[1:-1]), sizes
    r = httpx.post(server.url + path, json={**body, "stream_interval": 0}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_interval", r.text


@pytest.mark.parametrize(
    ("xargs", "status"),
    [
        ({"mode": "fast", "k": 3, "w": 0.5, "ids": [1, "a", 2.5]}, 200),
        ({"on": True, "flags": [False, 1]}, 200),  # vLLM's (lax) int takes a boolean
        ({"unset": None}, 400),
        ({"nested": {"a": 1}}, 400),
        ({"flags": [[1]]}, 400),
        ("a=1", 400),
    ],
)
def test_vllm_xargs_are_type_checked_and_unused(server, xargs, status) -> None:
    """vLLM's ``vllm_xargs``: strings, numbers or lists of them, accepted and changing nothing (no
    extension hook); any other shape is a 400 naming the field."""
    for path, body in (
        ("/v1/completions", {"prompt": PROMPT}),
        ("/v1/chat/completions", {"messages": MESSAGES}),
    ):
        body = {**body, "max_tokens": 4, "temperature": 0, **IDS}
        r = httpx.post(server.url + path, json={**body, "vllm_xargs": xargs}, timeout=60)
        assert r.status_code == status, r.text
        if status == 400:
            assert r.json()["error"]["param"].startswith("vllm_xargs"), r.text
        else:
            plain = httpx.post(server.url + path, json=body, timeout=60).json()
            assert r.json()["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]
