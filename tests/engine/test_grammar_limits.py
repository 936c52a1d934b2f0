"""Constraints whose grammar xgrammar (0.2.9) would match in milliseconds a token, or compile for
seconds, are refused before they compile, naming the keyword and the limit
(``engine/grammar_limits.py``; the costs are ``bench/grammar_cost.py``'s). Just under each limit
the constraint compiles and works."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import xgrammar as xgr

from engine.grammar_limits import MAX_VALUES_TEXT, regex_problem, schema_problem
from engine.sampling_params import StructuredOutputsParams as SO
from engine.structured_output import GrammarCompiler
from engine.tokenizer import Tokenizer

INT = {"type": "integer"}
REPEAT = (
    "above the 128 that structured outputs take (xgrammar matches a longer one slowly); write '*' "
    "or '+' and bound the length with max_tokens"
)


@pytest.fixture(scope="module")
def grammars(tiny_llama: Path) -> GrammarCompiler:
    tokenizer = Tokenizer.from_dir(tiny_llama)
    return GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)


def _refusal(grammars: GrammarCompiler, spec: SO) -> str:
    with pytest.raises(ValueError) as err:
        grammars.compile(spec)
    return str(err.value)


def _objects(count: int, required: int = 0) -> dict:
    names = [f"p{i}" for i in range(count)]
    return {"type": "object", "properties": dict.fromkeys(names, INT), "required": names[:required]}


@pytest.mark.parametrize(
    ("regex", "message"),
    [
        (".{0,500}", f"has the counted repetition '{{0,500}}' {REPEAT}"),
        ("a{129}", f"has the counted repetition '{{129}}' {REPEAT}"),
        ("[0-9]{200,}", f"has the counted repetition '{{200,}}' {REPEAT}"),
        ("[^]{500}", f"has the counted repetition '{{500}}' {REPEAT}"),  # '[^]': any character
        (
            "((\\w+ ){1,20}\\n){1,20}",
            f"has the counted repetition '{{1,20}}' inside another, 400 repetitions in all, {REPEAT}",
        ),
    ],
)
def test_long_counted_repetitions_in_a_regex_are_refused(grammars, regex: str, message: str) -> None:
    assert _refusal(grammars, SO(regex=regex)) == f"structured outputs regex {message}"


@pytest.mark.parametrize(
    "regex",
    [
        ".{0,128}",
        "(a{8}){16}",  # 128 in all
        "\\d{3}-\\d{4}",
        "\\{500}",  # a literal brace
        "[{]500}",
        "x\\{1,500\\}",
        "[x{500}]+",  # a class holding '{500}'
        "(\\w+\\s?)+",
    ],
)
def test_regexes_within_the_limit_compile(grammars, regex: str) -> None:
    assert regex_problem(regex) is None
    grammars.compile(SO(regex=regex))


def test_a_pattern_is_held_to_the_same_limit_wherever_it_is(grammars) -> None:
    schema = {
        "type": "object",
        "properties": {"items": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{250}$"}}},
    }
    assert _refusal(grammars, SO(json=schema)) == (
        "structured outputs json has the 'pattern' '^[a-z]{250}$' at #/properties/items/items, which "
        f"has the counted repetition '{{250}}' {REPEAT}"
    )
    names = {"type": "object", "patternProperties": {"^x.{0,300}$": INT}}
    assert schema_problem({"$defs": {"n": names}}) == (
        "has the 'pattern' '^x.{0,300}$' at #/$defs/n, which has the counted repetition "
        f"'{{0,300}}' {REPEAT}"
    )


def test_more_optional_properties_than_the_limit_are_refused(grammars) -> None:
    schema = {"type": "object", "properties": {"o": _objects(134, required=5)}}
    assert _refusal(grammars, SO(json=schema)) == (
        "structured outputs json has 129 optional properties at #/properties/o, above the 128 that "
        "structured outputs take in one object (its compile time grows with the cube of their "
        "number); list more of them in 'required'"
    )
    compiled = grammars.compile(
        SO(json=_objects(134, required=6), disable_any_whitespace=True)
    )  # 128 optional: at the limit
    assert xgr.GrammarMatcher(compiled).accept_string(json.dumps({f"p{i}": i for i in range(6)}))
    grammars.compile(SO(json=_objects(300, required=300)))  # required ones cost nothing


def test_the_same_limits_hold_in_a_structural_tag(grammars) -> None:
    tag = {"structures": [{"begin": "<f>", "schema": _objects(129), "end": "</f>"}], "triggers": ["<f>"]}
    assert _refusal(grammars, SO(structural_tag=tag)).startswith(
        "structured outputs structural_tag has 129 optional properties, above the 128"
    )


def test_an_enum_or_a_choice_too_long_is_refused(grammars) -> None:
    values = [f"value-{i:06d}" for i in range(6000)]  # 12 characters each, 14 as JSON
    assert _refusal(grammars, SO(json={"enum": values})) == (
        "structured outputs json has an 'enum' whose values come to 84000 characters, above the "
        f"{MAX_VALUES_TEXT} that structured outputs take (past them every token of the value costs "
        "milliseconds)"
    )
    assert _refusal(grammars, SO(choice=values)) == (
        "structured outputs choice is a list whose values come to 72000 characters, above the "
        f"{MAX_VALUES_TEXT} that structured outputs take (past them every token of the value costs "
        "milliseconds)"
    )
    compiled = grammars.compile(SO(json={"enum": values[:4000]}))
    matcher = xgr.GrammarMatcher(compiled)
    assert matcher.accept_string('"value-003999"') and matcher.accept_token(grammars.stop_token_ids[0])


@pytest.mark.parametrize("keyword", ["anyOf", "oneOf"])
def test_too_many_any_of_members_are_refused(grammars, keyword: str) -> None:
    members = [{"const": i} for i in range(1025)]
    assert _refusal(grammars, SO(json={"type": "object", "properties": {"k": {keyword: members}}})) == (
        f"structured outputs json has an '{keyword}' at #/properties/k of 1025 schemas, above the 1024 "
        "that structured outputs take"
    )
    compiled = grammars.compile(SO(json={keyword: members[:1024]}))
    assert xgr.GrammarMatcher(compiled).accept_string("1023")
