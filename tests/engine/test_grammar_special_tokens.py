"""A special token (``<|im_start|>``) is never part of a constrained output's text: xgrammar reads
the vocabulary's special tokens as their text, so a regex's "." or a JSON string's character took
them, and the detokenizer (which skips special tokens) then wrote text that no longer matched the
constraint: ``.{3,}`` answered "" and a string of ``minLength`` 3 ``"",``. The model is pushed
toward each special token with a logit bias; the output must still match."""

from __future__ import annotations

import json
import re

import pytest

from engine import LLM, SamplingParams
from engine.sampling_params import StructuredOutputsParams as SO


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), num_kv_blocks=256)


@pytest.fixture(scope="module")
def special_ids(llm) -> list[int]:
    ids = sorted(llm.tokenizer.all_special_ids)
    assert ids == [0, 1, 2]  # <|endoftext|>, <|im_start|>, <|im_end|> (the stop token)
    return ids


def _generate(llm: LLM, so: SO, bias: dict[int, float]) -> tuple[str, list[int], str]:
    params = SamplingParams(max_tokens=8, temperature=0, structured_outputs=so, logit_bias=bias)
    out = llm.generate(["hello"], params)[0].outputs[0]
    return out.text, out.token_ids, out.finish_reason


@pytest.mark.parametrize("regex", [".+", ".{3,}", "[a-z<|_>]{1,20}", "[^x]+"])
def test_a_regex_output_holds_no_special_token(llm, special_ids, regex: str) -> None:
    for token in special_ids:
        text, ids, reason = _generate(llm, SO(regex=regex), {token: 100.0})
        assert not set(ids[:-1]) & set(special_ids), (token, ids)  # the stop token may end it
        assert reason == "length" or re.fullmatch(regex, text, re.S), (token, text, reason)


def test_a_json_string_holds_no_special_token(llm, special_ids) -> None:
    for token in special_ids:
        text, ids, reason = _generate(llm, SO(json={"type": "string", "minLength": 3}), {token: 100.0})
        assert not set(ids[:-1]) & set(special_ids), (token, ids)
        assert reason == "length" or len(json.loads(text)) >= 3, (token, text)
