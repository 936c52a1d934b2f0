"""Over HTTP with the OpenAI SDK: a ``response_format`` JSON schema whose ``pattern`` matches text
with a quote, a backslash or a control character is served (it was a 400), and every answer is
valid JSON whose value matches the pattern (``engine/grammar_pattern_json.py``)."""

from __future__ import annotations

import json
import re

import openai
import pytest

from engine.tokenizer import Tokenizer

PATTERNS = ['^say "[a-z]{1,8}"$', "^[^,]{1,12}$", "^a\\\\b$", "^line1\\nline2$", "."]


@pytest.fixture(scope="module")
def sdk(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def no_spaces(tiny_llama) -> dict[str, float]:
    """A logit bias that keeps the random model from the whitespace JSON allows around values
    (``response_format`` has no ``disable_any_whitespace``): else it rambles in it to max_tokens."""
    tokenizer = Tokenizer.from_dir(tiny_llama)
    spaces = [t for t in range(tokenizer.vocab_size) if tokenizer.token_bytes(t).isspace()]
    return {str(t): -100.0 for t in spaces}


@pytest.fixture(scope="module")
def to_escapes(tiny_llama, no_spaces) -> dict[str, float]:
    """``no_spaces`` and a bias toward a quote and a backslash, so that the model writes escapes."""
    tokenizer = Tokenizer.from_dir(tiny_llama)
    quote, backslash = (str(tokenizer.encode(c, add_special_tokens=False)[-1]) for c in ('"', "\\"))
    return {**no_spaces, quote: 4.0, backslash: 8.0}


def _schema(pattern: str) -> dict:
    return {
        "type": "object",
        "properties": {"v": {"type": "string", "pattern": pattern}},
        "required": ["v"],
        "additionalProperties": False,
    }


@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_pattern_needing_escapes_is_served_as_valid_json(
    sdk, server, no_spaces, to_escapes, pattern
) -> None:
    values = []
    for seed in range(8):
        raw = sdk.chat.completions.with_raw_response.create(
            model=server.model_name,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=120,
            temperature=1.0,
            seed=seed,
            logit_bias=to_escapes if seed % 2 else no_spaces,
            response_format={"type": "json_schema", "json_schema": {"name": "v", "schema": _schema(pattern)}},
        )
        assert raw.status_code == 200
        choice = raw.parse().choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        value = json.loads(choice.message.content)
        assert list(value) == ["v"] and re.search(pattern, value["v"]), (pattern, value)
        values.append(value["v"])
    if pattern != ".":
        assert any(c in v for v in values for c in '"\\\n'), values  # escapes written, not avoided


def test_a_streamed_answer_is_valid_json_too(sdk, server, to_escapes) -> None:
    stream = sdk.chat.completions.create(
        model=server.model_name,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=120,
        temperature=1.0,
        seed=1,
        logit_bias=to_escapes,
        stream=True,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "v", "schema": _schema('^"[^,]{1,8}"$')},
        },
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert re.search('^"[^,]{1,8}"$', json.loads(text)["v"]), text
