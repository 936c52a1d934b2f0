"""Corners of one replica's OpenAI API where an SDK user would see ferry differ from what it
promises: legacy ``text_offset`` over multi-byte characters and echoed special tokens, and the
field a logprob limit's 400 names. Driven by the official openai SDK against a live `ferry serve`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from engine.tokenizer import Tokenizer

# Each CJK character is three byte-level tokens of the tiny tokenizer, the others two or three.
MULTIBYTE = "你好 wörld ☃ ok"
SPECIAL = "<|im_end|>"


def ids_of(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


def offsets_of(tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> list[int]:
    """Where each token starts in the decoded text: the length of the text of the tokens before it."""
    return [len(tokenizer.decode(ids[:i], skip_special_tokens=skip_special_tokens)) for i in range(len(ids))]


def test_text_offsets_across_multibyte_characters(client, tokenizer) -> None:
    prompt_ids = tokenizer.encode(MULTIBYTE)
    pieces = tokenizer.convert_ids_to_tokens(prompt_ids)
    assert len(prompt_ids) > len(MULTIBYTE.split()) + 6, pieces  # the characters come in pieces
    kw = dict(model=None, max_tokens=6, temperature=0, logprobs=0, extra_body={"ignore_eos": True})
    # Echoed, as a string and as ids, whole and streamed: the prompt's pieces.
    for prompt in (MULTIBYTE, prompt_ids):
        whole = client.completions.create(prompt=prompt, echo=True, **kw).choices[0]
        by_id = client.completions.create(
            prompt=prompt,
            echo=True,
            **{**kw, "extra_body": {"ignore_eos": True, "return_tokens_as_token_ids": True}},
        ).choices[0]
        ids = ids_of(by_id.logprobs.tokens)
        assert ids[: len(prompt_ids)] == prompt_ids and whole.text == tokenizer.decode(ids)
        assert whole.logprobs.text_offset == offsets_of(tokenizer, ids)
        assert whole.logprobs.text_offset[prompt_ids.index(tokenizer.encode(" w")[0])] == 2  # after "你好"
        streamed = list(client.completions.create(prompt=prompt, echo=True, stream=True, **kw))
        assert [o for c in streamed for o in c.choices[0].logprobs.text_offset] == whole.logprobs.text_offset
    # Generated: a constraint makes the model write multi-byte characters, offsets carried across
    # the stream's deltas.
    forced = {"guided_regex": "你好 ☃ wörld", "return_tokens_as_token_ids": True}
    gen = client.completions.create(prompt="x", **{**kw, "max_tokens": 40, "extra_body": forced}).choices[0]
    ids = ids_of(gen.logprobs.tokens)
    assert gen.text == "你好 ☃ wörld" and len(ids) > 6
    assert gen.logprobs.text_offset == offsets_of(tokenizer, ids)
    chunks = list(
        client.completions.create(prompt="x", stream=True, **{**kw, "max_tokens": 40, "extra_body": forced})
    )
    assert [o for c in chunks for o in c.choices[0].logprobs.text_offset] == gen.logprobs.text_offset


def test_echo_offsets_follow_special_tokens_in_the_echoed_text(client, tokenizer) -> None:
    kw = dict(model=None, max_tokens=3, temperature=0, echo=True, logprobs=0)

    def answer(prompt, skip: bool):
        extra = {"ignore_eos": True, "skip_special_tokens": skip}
        shown = client.completions.create(prompt=prompt, extra_body=extra, **kw).choices[0]
        by_id = client.completions.create(
            prompt=prompt, extra_body={**extra, "return_tokens_as_token_ids": True}, **kw
        ).choices[0]
        return shown, ids_of(by_id.logprobs.tokens)

    # A string prompt is echoed as the client wrote it, the special token's text included.
    text = f"hello{SPECIAL} world"
    for skip in (True, False):
        shown, ids = answer(text, skip)
        assert shown.text.startswith(text)
        offsets, n = shown.logprobs.text_offset, len(tokenizer.encode(text))
        assert offsets[:n] == offsets_of(tokenizer, ids[:n], skip_special_tokens=False)
        for token, at in zip(shown.logprobs.tokens, offsets, strict=True):
            assert shown.text[at : at + len(token)] == token, (token, at, shown.text)
    # Token ids are echoed as generated text reads: the special token shown only when not skipped.
    ids_in = tokenizer.encode("hel") + [tokenizer.encode(SPECIAL, add_special_tokens=False)[0]]
    ids_in += tokenizer.encode("lo world")
    for skip in (True, False):
        shown, ids = answer(ids_in, skip)
        assert shown.text == tokenizer.decode(ids, skip_special_tokens=skip)
        assert (SPECIAL in shown.text) is (not skip)
        assert shown.logprobs.text_offset == offsets_of(tokenizer, ids, skip)


@pytest.fixture(scope="module")
def five_logprobs(tiny_llama: Path, serve_logs: Path, server_process) -> Iterator[openai.OpenAI]:
    srv = server_process(tiny_llama, ["--max-logprobs", "5"], serve_logs).start()
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    srv.stop()


def test_logprob_limits_name_the_field(five_logprobs) -> None:
    messages = [{"role": "user", "content": "hi"}]
    cases = [
        (five_logprobs.chat.completions.create, dict(messages=messages, logprobs=True, top_logprobs=6), "top_logprobs"),
        (five_logprobs.chat.completions.create, dict(messages=messages, extra_body={"prompt_logprobs": 6}), "prompt_logprobs"),
        (five_logprobs.completions.create, dict(prompt="hi", logprobs=6), "logprobs"),
        (five_logprobs.completions.create, dict(prompt="hi", extra_body={"prompt_logprobs": 6}), "prompt_logprobs"),
    ]  # fmt: skip
    for create, kw, param in cases:
        with pytest.raises(openai.BadRequestError) as refused:
            create(model=None, max_tokens=2, **kw)
        assert refused.value.body["param"] == param
        assert refused.value.body["message"] == f"{param} must be at most 5, got 6"
    ok = five_logprobs.chat.completions.create(
        model=None, messages=messages, max_tokens=2, logprobs=True, top_logprobs=5
    )
    assert len(ok.choices[0].logprobs.content[0].top_logprobs) == 5


def test_chat_chunks_of_partial_characters_carry_empty_content(client) -> None:
    """A streamed chat token that is only part of a character (its logprobs go out at once) has
    ``"content": ""`` in its delta, as OpenAI and vLLM send it, not an empty delta. (A server that
    falls behind may fold a piece into the chunk that completes its character: three streams, so
    that some piece goes out on its own.)"""
    partial = []
    for _ in range(3):
        stream = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=12,
            temperature=0,
            logprobs=True,
            stream=True,
            extra_body={"guided_regex": "你好☃"},
        )
        chunks = [c for c in stream if c.choices]
        tokens = [c for c in chunks if c.choices[0].logprobs and c.choices[0].logprobs.content]
        partial += [c for c in tokens if not c.choices[0].delta.content and not c.choices[0].finish_reason]
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == "你好☃"
    assert partial  # pieces of a character: nothing to show yet
    assert all(c.choices[0].delta.content == "" for c in partial)


def test_an_assistant_refusal_part_reads_as_its_text(client, server) -> None:
    """An earlier assistant turn whose content is OpenAI's ``refusal`` part (the SDK's
    ``ChatCompletionContentPartRefusalParam``) is rendered as that text, as vLLM renders it: the
    same prompt as the text part."""

    def history(part: dict) -> list[dict]:
        return [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [part]},
            {"role": "user", "content": "why?"},
        ]

    as_text = history({"type": "text", "text": "I can't help with that."})
    refused = history({"type": "refusal", "refusal": "I can't help with that."})
    ids = httpx.post(server.url + "/tokenize", json={"messages": as_text}).json()["tokens"]
    assert httpx.post(server.url + "/tokenize", json={"messages": refused}).json()["tokens"] == ids
    answer = client.chat.completions.create(model=None, messages=refused, max_tokens=1)
    assert answer.usage.prompt_tokens == len(ids)
    # Continued and echoed (vLLM's echo), the answer starts with the refusal's words.
    continued = client.chat.completions.create(
        model=None,
        messages=refused[:2],
        max_tokens=1,
        extra_body={"echo": True, "continue_final_message": True, "add_generation_prompt": False},
    )
    assert continued.choices[0].message.content.startswith("I can't help with that.")
