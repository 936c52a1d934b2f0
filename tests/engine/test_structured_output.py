"""Structured outputs in the engine: every constraint kind, checked by an independent reader of the
output (json.loads, re.fullmatch, exact sets), exact greedy choices, and the paths a request can
take (n > 1, preemption, resume, min_tokens, ignore_eos, bad constraints)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest_helpers import record_logits

from engine.grammar_matcher import mask_to_grammars
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.sampling_params import StructuredOutputsParams as SO
from engine.structured_output import choice_grammar

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "color", "n"],
    "additionalProperties": False,
}
PROMPTS = ["Hello world", "def f(x):", "import os", "class A:"]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    engine = LLM(str(tiny_llama), num_kv_blocks=256)
    yield engine
    engine.close()


def _texts(outs) -> list[tuple[str, str]]:
    return [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


def _check_schema(text: str) -> None:
    value = json.loads(text)
    assert list(value) == ["ok", "color", "n"]  # the schema's order, all required, nothing more
    assert isinstance(value["ok"], bool)
    assert value["color"] in ("red", "green", "blue")
    assert isinstance(value["n"], int) and 0 <= value["n"] <= 99


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_parses_and_conforms(llm, temperature) -> None:
    params = SamplingParams(
        max_tokens=60,
        temperature=temperature,
        seed=3,
        structured_outputs=SO(json=SCHEMA, disable_any_whitespace=True),
    )
    for text, reason in _texts(llm.generate(PROMPTS, params)):
        assert reason == "stop", text
        _check_schema(text)


def test_unconstrained_output_is_not_json(llm) -> None:
    # The model is random: without the grammar its output is not JSON, so the tests above see the mask.
    for text, _ in _texts(llm.generate(PROMPTS, SamplingParams(max_tokens=30, temperature=0.0))):
        with pytest.raises(json.JSONDecodeError):
            json.loads(text)


def test_regex_choice_and_grammar(llm) -> None:
    cases = [
        (SO(regex=r"[a-c]{3}-\d{2}"), lambda t: re.fullmatch(r"[a-c]{3}-\d{2}", t)),
        (SO(choice=["yes", "no", 'say "hi"\n']), lambda t: t in ("yes", "no", 'say "hi"\n')),
        (SO(grammar='root ::= "x" [0-9] [0-9]? "y"'), lambda t: re.fullmatch(r"x\d\d?y", t)),
    ]
    for spec, check in cases:
        for temperature in (0.0, 1.0):
            outs = llm.generate(
                PROMPTS,
                SamplingParams(max_tokens=20, temperature=temperature, seed=1, structured_outputs=spec),
            )
            for text, reason in _texts(outs):
                assert reason == "stop" and check(text), (spec, text)


def test_json_object_with_whitespace_allowed(llm) -> None:
    # Biasing "}" up makes the smallest object the likeliest; the grammar still has to open it and
    # end it (EOS) where the unconstrained model would write "}}}}...".
    close = llm.engine.tokenizer.encode("}", add_special_tokens=False)
    assert len(close) == 1
    params = SamplingParams(
        max_tokens=10, temperature=0.0, logit_bias={close[0]: 100.0}, structured_outputs=SO(json_object=True)
    )
    for text, reason in _texts(llm.generate(PROMPTS, params)):
        assert reason == "stop" and json.loads(text) == {}, text


def _allowed(tokenizer, prefix: bytes, choices: list[bytes], eos: tuple[int, ...], vocab: int) -> list[int]:
    allowed = [
        t
        for t in range(vocab)
        if t not in tokenizer.all_special_ids
        and (b := tokenizer.token_bytes(t))
        and any(c.startswith(prefix + b) for c in choices)
    ]
    if prefix in choices:
        allowed += list(eos)
    return allowed


def test_greedy_choice_is_the_argmax_over_allowed_tokens(llm) -> None:
    """Exact: at each step the token is the argmax of the raw logits over the tokens that keep the
    text a prefix of a choice (EOS once it is one): the allowed set computed here from token bytes,
    independently of xgrammar."""
    choices = ["alpha beta", "alphabet", "gamma", "delta epsilon"]
    engine, tokenizer = llm.engine, llm.engine.tokenizer
    seen = record_logits(llm)
    outs = llm.generate(
        PROMPTS, SamplingParams(max_tokens=20, temperature=0.0, structured_outputs=SO(choice=choices))
    )
    raw = [c.encode() for c in choices]
    for out in outs:
        steps = seen[out.request_id]
        tokens = out.outputs[0].token_ids
        assert len(steps) == len(tokens)
        prefix = b""
        for logits, token in zip(steps, tokens, strict=True):
            allowed = _allowed(tokenizer, prefix, raw, engine.eos_token_ids, engine.sampling_vocab_size)
            best = max(allowed, key=lambda t: float(logits[t]))
            assert token == best
            if token not in engine.eos_token_ids:
                prefix += tokenizer.token_bytes(token)
        assert out.outputs[0].text in choices and out.outputs[0].finish_reason == "stop"
    engine.logits_observers.clear()


def test_n_children_each_follow_their_own_grammar(llm) -> None:
    outs = llm.generate(
        ["Hello"],
        SamplingParams(n=4, max_tokens=20, temperature=1.0, seed=5, structured_outputs=SO(regex=r"[0-9]{6}")),
    )
    texts = [c.text for c in outs[0].outputs]
    assert len(texts) == 4 and all(re.fullmatch(r"[0-9]{6}", t) for t in texts)
    assert len(set(texts)) > 1  # independent draws


def test_preempted_requests_stay_in_their_grammar(tiny_llama) -> None:
    llm = LLM(str(tiny_llama), num_kv_blocks=12, max_num_batched_tokens=128)
    try:
        prompts = [[5 + i] * 40 for i in range(8)]
        params = SamplingParams(
            max_tokens=60,
            temperature=1.0,
            seed=2,
            structured_outputs=SO(json=SCHEMA, disable_any_whitespace=True),
        )
        outs = llm.generate(prompts, params)
        assert llm.engine.stats().num_preemptions > 0
        for text, reason in _texts(outs):
            assert reason == "stop"
            _check_schema(text)
    finally:
        llm.close()


def test_min_tokens_cannot_outlast_a_finished_grammar(llm) -> None:
    # min_tokens masks EOS, but "yes" admits nothing after it: the grammar wins and the output ends.
    params = SamplingParams(
        max_tokens=10, min_tokens=8, temperature=0.0, structured_outputs=SO(choice=["yes"])
    )
    assert _texts(llm.generate(PROMPTS[:1], params)) == [("yes", "stop")]


def test_allowed_token_ids_outside_the_grammar_give_way(llm) -> None:
    # No allowed id is a digit: every step's masks contradict; the grammar wins each time.
    letters = llm.engine.tokenizer.encode("abc", add_special_tokens=False)
    params = SamplingParams(
        max_tokens=10, temperature=0.0, allowed_token_ids=letters, structured_outputs=SO(regex="[0-9]{3}")
    )
    out = llm.generate(PROMPTS[:2], params)
    assert all(
        re.fullmatch("[0-9]{3}", o.outputs[0].text) and o.outputs[0].finish_reason == "stop" for o in out
    )


def test_ignore_eos_stops_once_the_grammar_is_complete(llm) -> None:
    params = SamplingParams(
        max_tokens=10, ignore_eos=True, temperature=0.0, structured_outputs=SO(choice=["yes"])
    )
    out = llm.generate(PROMPTS[:1], params)[0].outputs[0]
    assert (out.text, out.finish_reason) == ("yes", "stop")
    assert out.token_ids[-1] in llm.engine.eos_token_ids


def test_resumed_tokens_must_follow_the_grammar(llm) -> None:
    engine = llm.engine
    spec = SO(regex=r"[0-9]{4}")
    digits = engine.tokenizer.encode("12", add_special_tokens=False)
    letters = engine.tokenizer.encode("ab", add_special_tokens=False)
    params = SamplingParams(max_tokens=10, temperature=0.0, structured_outputs=spec)
    req = engine.make_request("resume-ok", "Hello", params, resume_token_ids=digits)
    assert req.grammar is not None and not req.grammar.terminated
    with pytest.raises(ValueError, match="does not follow the request's structured outputs"):
        engine.make_request("resume-bad", "Hello", params, resume_token_ids=letters)


def test_a_constraint_after_a_token_starts_there(llm) -> None:
    """``after_token_id`` (a reasoning model's end of thinking): tokens before it are free, resumed
    ones included; the grammar takes over from the token after it."""
    engine = llm.engine
    tokenizer = engine.tokenizer
    (marker,) = tokenizer.encode("}", add_special_tokens=False)
    free = tokenizer.encode("no digits here", add_special_tokens=False)
    spec = SO(regex=r"[0-9]{4}", after_token_id=marker)
    assert engine.grammars.cached(spec) is engine.grammars.compile(SO(regex=r"[0-9]{4}"))  # one grammar
    params = SamplingParams(max_tokens=12, temperature=0.0, structured_outputs=spec)
    waiting = engine.make_request("after-wait", "Hello", params, resume_token_ids=free)
    assert waiting.grammar.waiting_for == marker and not waiting.grammar.active
    out = llm.generate(
        ["Hello"],
        SamplingParams(max_tokens=40, temperature=0.0, logit_bias={marker: 100.0}, structured_outputs=spec),
    )
    o = out[0].outputs[0]
    assert o.token_ids[0] == marker  # free: the bias wins before the grammar starts
    assert re.fullmatch(r"\}[0-9]{4}", o.text) and o.finish_reason == "stop"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (SO(regex="("), "invalid structured outputs regex: .*parenthesis"),
        (SO(json='{"type": "nope"}'), "invalid structured outputs json: .*nope"),
        (SO(json="{bad"), "not valid JSON"),
        (SO(grammar="root ::= "), "invalid structured outputs grammar"),
        (SO(choice=[]), "choice must be a non-empty list"),
        (SO(regex="a", choice=["a"]), "exactly one of .*got regex, choice"),
        (SO(), "exactly one of .*got none"),
    ],
)
def test_bad_constraints_are_value_errors(llm, spec, message) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=spec))
    assert not llm.engine.has_unfinished_requests()


def _nested(depth: int) -> str:
    schema = '{"type": "integer"}'
    for _ in range(depth):
        schema = '{"type": "array", "items": ' + schema + "}"
    return schema


def test_schema_depth_is_bounded(llm) -> None:
    # 63 arrays in an integer schema = 64 JSON levels: the limit, compiled. One more, or a depth
    # Python's own parser cannot take (which would raise RecursionError), is a ValueError.
    llm.engine.grammars.compile(SO(json=_nested(63)))
    for depth in (64, 2000):
        with pytest.raises(ValueError, match="nested more than 64 levels deep"):
            llm.engine.grammars.compile(SO(json=_nested(depth)))


def test_compiled_grammars_are_cached_per_constraint(llm) -> None:
    grammars = llm.engine.grammars
    a = grammars.compile(SO(json=SCHEMA))
    assert grammars.compile(SO(json=json.loads(json.dumps(SCHEMA)))) is a  # equal schema, same grammar
    assert grammars.cached(SO(json=SCHEMA, disable_any_whitespace=True)) is not a


def test_mask_to_grammars_masks_only_constrained_rows_like_xgrammar(llm) -> None:
    import xgrammar as xgr

    grammars = llm.engine.grammars
    vocab = llm.engine.sampling_vocab_size
    x = grammars.matcher(grammars.compile(SO(choice=["x"])))
    digits = grammars.matcher(grammars.compile(SO(regex="[0-9]+")))
    logits = torch.randn(3, vocab)
    original = logits.clone()
    masked, rows = mask_to_grammars(logits, [None, x, digits])
    assert rows == [1, 2] and torch.equal(logits, original)  # the input is left alone
    assert torch.equal(masked[0], original[0])
    allowed = torch.isfinite(masked[1]).nonzero().view(-1).tolist()
    assert allowed == llm.engine.tokenizer.encode("x", add_special_tokens=False)
    # Row by row the same as xgrammar's own kernel.
    reference = original.clone()
    bitmask = xgr.allocate_token_bitmask(3, vocab)
    x.fill(bitmask, 1)
    digits.fill(bitmask, 2)
    xgr.apply_token_bitmask_inplace(reference, bitmask, indices=[1, 2])
    assert torch.equal(masked, reference)
    every, _ = mask_to_grammars(original[1:], [x, digits])  # all rows constrained: the other path
    assert torch.equal(every, reference[1:])


def test_choice_grammar_escapes_quotes_and_newlines() -> None:
    assert choice_grammar(['a"b', "c\nd", "e\\f"]) == 'root ::= "a\\"b" | "c\\nd" | "e\\\\f"'
