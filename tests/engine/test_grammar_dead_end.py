"""A structured-outputs constraint that allows a first token and later no token at all (a dead end)
ends its request with ``finish_reason="abort"`` and an ``error`` naming the dead end, a warning log
naming it, and no text of the token drawn from the empty mask; a constraint whose language is
empty (no sentence at all: an empty character class on every path, a rule with no way to end, a
JSON pattern that matches no text) is refused before it runs."""

from __future__ import annotations

import json
import logging
import re

import pytest

from engine.grammar_errors import DEAD_END, error_code
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.sampling_params import StructuredOutputsParams as SO

# Not empty ("b" is in it), so nothing refuses it before it runs; the model, pushed to "a", walks
# into the branch that matches nothing after it.
ONE_BRANCH_DEAD = SO(regex="b|a[^\\s\\S]")


@pytest.fixture(scope="module")
def llm(tiny_llama):
    engine = LLM(str(tiny_llama), num_kv_blocks=128)
    yield engine
    engine.close()


def _run(llm: LLM, so: SO, **kw):
    params = SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=so, **kw)
    return llm.generate(["Hello world"], params)[0].outputs[0]


def test_a_dead_end_ends_with_its_reason_and_a_warning(llm, caplog) -> None:
    a = llm.tokenizer.encode("a")[-1]
    with caplog.at_level(logging.WARNING, logger="engine.postprocess"):
        out = _run(llm, ONE_BRANCH_DEAD, logit_bias={a: 100.0})
    assert out.finish_reason == "abort"
    assert out.error is not None and out.error.startswith(DEAD_END + " after the 1 token(s) generated ('a')")
    assert error_code(out.error) == "structured_outputs_dead_end"
    # The token drawn from the empty mask is not written: the text is what the grammar allowed.
    assert out.text == "a"
    records = [r for r in caplog.records if r.name == "engine.postprocess"]
    assert [r.levelno for r in records] == [logging.WARNING]
    assert DEAD_END in records[0].getMessage() and "token 0" not in records[0].getMessage()


def test_the_cost_error_keeps_its_code() -> None:
    assert error_code("The structured outputs constraint was ended: enforcing it cost 3 ms") == (
        "structured_outputs_too_costly"
    )


@pytest.mark.parametrize(
    "so",
    [
        SO(regex="a[^\\s\\S]"),
        SO(regex="(a|b)[^\\s\\S]c*"),
        SO(grammar='root ::= "a" r\nr ::= r "b"'),
        SO(grammar='root ::= "a" r | "c" s\nr ::= "x" r\ns ::= [^\\0-\\U0010ffff]'),
    ],
    ids=["empty-class", "empty-class-after-choice", "no-way-to-end", "every-branch-dead"],
)
def test_a_constraint_with_no_sentence_is_refused_before_it_runs(llm, so) -> None:
    with pytest.raises(ValueError, match="no output can satisfy it \\(every way through it needs an empty"):
        _run(llm, so)


@pytest.mark.parametrize(
    "so",
    [
        SO(regex="b|a[^\\s\\S]"),
        SO(grammar='root ::= "a" r\nr ::= r "b" | "c"'),
        SO(grammar='root ::= "a" [^\\0-\\U0010ffff]*'),
        SO(regex="[^x]{0,3}"),
        SO(json={"type": "string", "pattern": '^(a|")$'}),
        SO(json={"type": "string", "pattern": '^[^"]+$'}),
    ],
    ids=[
        "one-branch-live",
        "recursion-with-an-end",
        "empty-class-starred",
        "negated-class",
        "pattern-quote-optional",
        "pattern-no-quote",
    ],
)
def test_a_constraint_with_a_sentence_is_not_refused(llm, so) -> None:
    assert llm.engine.grammars.compile(so) is not None


@pytest.mark.parametrize("pattern", ["^a[^\\s\\S]$", "^(?:b[^\\s\\S]|[^\\s\\S])c$"])
def test_a_json_pattern_with_no_sentence_is_refused_before_it_runs(llm, pattern) -> None:
    schema = {"type": "object", "properties": {"v": {"type": "string", "pattern": pattern}}}
    with pytest.raises(ValueError, match=f"the pattern {re.escape(repr(pattern))} matches no text"):
        _run(llm, SO(json=schema))


@pytest.mark.parametrize("pattern", ['^a"$', "^a\\\\b$", "^\\n{1,3}$", "^[\\x00-\\x1f]$"])
def test_a_json_pattern_that_needs_an_escape_runs(llm, pattern) -> None:
    # It was refused (its automaton wrote no escape: a dead end after `"a`); it is matched as JSON
    # text now, so the output is JSON whose value matches (tests/engine/test_pattern_escaped_json.py).
    schema = {
        "type": "object",
        "properties": {"v": {"type": "string", "pattern": pattern}},
        "required": ["v"],
    }
    params = SamplingParams(
        max_tokens=40, temperature=0.0, structured_outputs=SO(json=schema, disable_any_whitespace=True)
    )
    out = llm.generate(["Hello world"], params)[0].outputs[0]
    assert out.finish_reason == "stop", out.text
    assert re.search(pattern, json.loads(out.text)["v"]), out.text
