"""How structured outputs read JSON schemas where xgrammar alone would let output break them.

Strings with ``minLength`` / ``maxLength`` under structured outputs are valid JSON: xgrammar
(0.2.9) writes their characters as any but quote, backslash, CR and LF, so a model could emit a raw
control character (which a strict JSON parser refuses) and no escape (mlc-ai/xgrammar#800). Their
characters are JSON's unescaped ones, at every bound: xgrammar matches a counted repetition of
JSON's escaping rule in milliseconds a token (``bench/grammar_cost.py``).
A required property that `properties` lacks: xgrammar drops the name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import xgrammar as xgr

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.sampling_params import StructuredOutputsParams as SO
from engine.structured_output import GrammarCompiler
from engine.tokenizer import Tokenizer

INT = {"type": "integer"}
BOUNDED = {
    "type": "object",
    "properties": {
        "s": {"type": "string", "maxLength": 3},
        "t": {"type": "array", "items": {"type": "string", "minLength": 2}},
    },
    "required": ["s", "t"],
}


@pytest.fixture(scope="module")
def grammars(tiny_llama: Path) -> GrammarCompiler:
    tokenizer = Tokenizer.from_dir(tiny_llama)
    return GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ('{"s": "abc", "t": []}', True),
        ('{"s": "\u00e9\u00e9\u00e9", "t": ["\u00e9A"]}', True),  # a character, not a byte
        ('{"s": "", "t": ["\U0001f600x"]}', True),  # one character outside the basic plane
        ('{"s": "", "t": ["\U0001f600"]}', False),  # one character: under minLength
        ('{"s": "a\x14b", "t": []}', False),  # a raw control character is not JSON
        ('{"s": "a\tb", "t": []}', False),
        ('{"s": "abcd", "t": []}', False),  # over maxLength
        # No escape, at any bound: its rule made every token cost milliseconds.
        ('{"s": "a\\nb", "t": []}', False),
        ('{"s": "", "t": ["\\u00e9A"]}', False),
        ('{"s": "a\\"", "t": []}', False),
    ],
)
def test_bounded_strings_take_unescaped_json_characters(grammars, text: str, ok: bool) -> None:
    matcher = xgr.GrammarMatcher(grammars.compile(SO(json=BOUNDED, disable_any_whitespace=True)))
    whole = matcher.accept_string(text) and matcher.accept_token(grammars.stop_token_ids[0])
    assert whole is ok


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ('{"s": "ab", "t": "' + "x" * 1000 + '"}', True),
        ('{"s": "ab", "t": "a\\nb' + "x" * 1000 + '"}', False),  # no escape
        ('{"s": "ab", "t": "a\x14b' + "x" * 1000 + '"}', False),  # nor a raw control character
        ('{"s": "ab", "t": "' + "x" * 999 + '"}', False),  # under minLength
    ],
)
def test_long_bounded_strings_take_unescaped_json_characters(grammars, text: str, ok: bool) -> None:
    schema = {
        "type": "object",
        "properties": {"s": {"type": "string", "maxLength": 128}, "t": {"type": "string", "minLength": 1000}},
        "required": ["s", "t"],
    }
    matcher = xgr.GrammarMatcher(grammars.compile(SO(json=schema, disable_any_whitespace=True)))
    whole = matcher.accept_string(text) and matcher.accept_token(grammars.stop_token_ids[0])
    assert whole is ok


@pytest.mark.parametrize(
    ("raw", "ok"),
    [
        ("\u00e9".encode(), True),
        ("\ud7ff".encode(), True),  # the last character before the surrogates
        (b"\xed\xa0\x80", False),  # a surrogate's UTF-8 form: no UTF-8 (decodes as 3 characters)
    ],
)
def test_bounded_strings_take_no_surrogate(grammars, raw: bytes, ok: bool) -> None:
    matcher = xgr.GrammarMatcher(grammars.compile(SO(json={"type": "string", "maxLength": 2})))
    assert matcher.accept_string(b'"' + raw + b'"') is ok


def test_unbounded_strings_keep_their_escapes(grammars) -> None:
    """Only a bounded string loses its escapes (xgrammar's own rule for an unbounded one is cheap)."""
    schema = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}
    matcher = xgr.GrammarMatcher(grammars.compile(SO(json=schema, disable_any_whitespace=True)))
    assert matcher.accept_string('{"s": "a\\n\\"\\u00e9"}')
    assert matcher.accept_token(grammars.stop_token_ids[0])


def test_generated_bounded_strings_parse_as_strict_json(tiny_llama: Path) -> None:
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "string", "maxLength": 12},
            "b": {"type": "string", "minLength": 4, "maxLength": 12},
        },
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    params = SamplingParams(n=16, max_tokens=200, temperature=1.0, seed=3, structured_outputs=SO(json=schema))
    with LLM(str(tiny_llama), num_kv_blocks=512) as llm:
        (out,) = llm.generate(["Tell me about it:"], params)
    finished = [c for c in out.outputs if c.finish_reason == "stop"]
    assert len(finished) >= 8
    for completion in finished:
        value = json.loads(completion.text)  # strict: raw control characters are refused
        assert len(value["a"]) <= 12 and 4 <= len(value["b"]) <= 12


@pytest.mark.parametrize(
    ("schema", "text", "ok"),
    [
        # A required name ``properties`` lacks: xgrammar alone took ``{}`` and refused ``{"x": 1}``.
        ({"type": "object", "required": ["x"]}, '{"x": 1}', True),
        ({"type": "object", "required": ["x"]}, "{}", False),
        ({"type": "object", "properties": {"y": INT}, "required": ["x", "y"]}, '{"y": 2, "x": [1]}', True),
        ({"type": "object", "properties": {"y": INT}, "required": ["x", "y"]}, '{"y": 2}', False),
        # The undeclared name takes the schema additionalProperties gives it.
        ({"type": "object", "required": ["x"], "additionalProperties": INT}, '{"x": 1}', True),
        ({"type": "object", "required": ["x"], "additionalProperties": INT}, '{"x": "a"}', False),
        # Nested, and in $defs.
        (
            {"type": "object", "properties": {"o": {"$ref": "#/$defs/o"}}, "required": ["o"],
             "$defs": {"o": {"type": "object", "required": ["k"]}}},
            '{"o": {"k": null}}',
            True,
        ),
        (
            {"type": "object", "properties": {"o": {"$ref": "#/$defs/o"}}, "required": ["o"],
             "$defs": {"o": {"type": "object", "required": ["k"]}}},
            '{"o": {}}',
            False,
        ),
        # ``required`` means nothing for a value that is not an object.
        ({"type": "string", "required": ["x"]}, '"s"', True),
    ],
)  # fmt: skip
def test_required_names_that_properties_lacks_are_required(grammars, schema, text: str, ok: bool) -> None:
    matcher = xgr.GrammarMatcher(grammars.compile(SO(json=schema, disable_any_whitespace=True)))
    whole = matcher.accept_string(text) and matcher.accept_token(grammars.stop_token_ids[0])
    assert whole is ok


def test_a_required_name_additional_properties_rules_out_is_refused(grammars) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "object", "required": ["k"],
              "additionalProperties": False}}}  # fmt: skip
    with pytest.raises(ValueError) as err:
        grammars.compile(SO(json=schema))
    assert str(err.value) == (
        "structured outputs json requires the property 'k' at #/properties/a, "
        "which its 'additionalProperties' rules out"
    )


@pytest.mark.parametrize("form", ["format", "structures"])
def test_bounded_strings_in_structural_tags_take_unescaped_json_characters(grammars, form: str) -> None:
    """A tool call's schema inside a structural tag (both of its forms) gets the same JSON strings."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 3}}, "required": ["s"]}
    if form == "format":
        content = {"type": "json_schema", "json_schema": schema}
        tag = {
            "type": "structural_tag",
            "format": {"type": "tag", "begin": "<f>", "content": content, "end": "</f>"},
        }
    else:
        tag = {"structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}], "triggers": ["<f>"]}
    compiled = grammars.compile(SO(structural_tag=tag))
    bodies = (
        ('{"s": "abc"}', True),
        ('{"s": "a\\n"}', False),
        ('{"s": "a\x14b"}', False),
        ('{"s": "abcd"}', False),
    )
    for body, ok in bodies:
        matcher = xgr.GrammarMatcher(compiled)
        assert matcher.accept_string("<f>" + body + "</f>") is ok, body


@pytest.mark.parametrize("form", ["format", "structures"])
def test_structural_tag_schemas_merge_all_of_and_declare_required(grammars, form: str) -> None:
    """A structural tag's schemas are rewritten as a json constraint's: an allOf merged (was a 400),
    a required name that properties lacks declared (xgrammar dropped it: output could lack it)."""
    schema = {
        "allOf": [
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"type": "object", "required": ["b"]},
        ]
    }
    if form == "format":
        content = {"type": "json_schema", "json_schema": schema}
        tag = {
            "type": "structural_tag",
            "format": {"type": "tag", "begin": "<f>", "content": content, "end": "</f>"},
        }
    else:  # the older form, its schema as JSON text
        tag = {
            "structures": [{"begin": "<f>", "schema": json.dumps(schema), "end": "</f>"}],
            "triggers": ["<f>"],
        }
    compiled = grammars.compile(SO(structural_tag=tag, disable_any_whitespace=True))
    for body, ok in (('{"a": 1, "b": null}', True), ('{"a": 1}', False), ('{"b": 2}', False)):
        matcher = xgr.GrammarMatcher(compiled)
        assert matcher.accept_string("<f>" + body + "</f>") is ok, body


def test_structural_tag_all_of_that_cannot_hold_is_refused(grammars) -> None:
    schema = {"allOf": [{"type": "integer"}, {"type": "string"}]}
    tag = {"structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}], "triggers": ["<f>"]}
    with pytest.raises(ValueError) as err:
        grammars.compile(SO(structural_tag=tag))
    assert str(err.value) == (
        "structured outputs structural_tag has an 'allOf' that no JSON value satisfies: "
        "its members share no 'type' ('integer' and 'string')"
    )
