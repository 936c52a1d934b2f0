"""Constraints refused when they compile (ValueError; a 400 at the HTTP edge) rather than half
applied: a JSON schema using a keyword xgrammar compiles without enforcing it, and a constraint no
output can satisfy.

Every refused schema comes with JSON that breaks only the refused keyword, and the test holds
xgrammar to accepting it: that is why it is refused (a later xgrammar that enforces the keyword
fails that test, and the keyword can then be allowed). Every allowed schema comes with JSON that
breaks it, which xgrammar must reject.
"""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Annotated, Literal

import pytest
from pydantic import BaseModel, Field
from xgrammar import Grammar
from xgrammar.testing import _is_grammar_accept_string

from engine.json_schema_support import unenforced_keyword
from engine.sampling_params import StructuredOutputsParams as SO
from engine.structured_output import GrammarCompiler
from engine.tokenizer import Tokenizer

INT, STR = {"type": "integer"}, {"type": "string"}
# (schema, JSON breaking it only through the refused keyword, the refusal after "keyword ")
REFUSED = [
    ({"type": "array", "items": INT, "uniqueItems": True}, "[1, 1]", "'uniqueItems'"),
    ({"type": ["string", "integer"], "not": STR}, '"a"', "'not'"),
    ({"type": "array", "items": INT, "contains": {"const": 5}}, "[1]", "'contains'"),
    ({"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 6}}, "7", "'if'"),
    (
        {"type": "object", "properties": {"a": INT, "b": INT}, "dependentRequired": {"a": ["b"]}},
        '{"a": 1}',
        "'dependentRequired'",
    ),
    (
        {"type": "integer", "multipleOf": 7, "maximum": 100},
        "99",
        "'multipleOf' with a lower or an upper bound alone",
    ),
    ({"type": "integer", "multipleOf": 1025}, "1026", "'multipleOf' with a value above 1024"),
    (
        {"type": "integer", "multipleOf": 7, "minimum": 0, "maximum": 10000},
        "9998",
        "'multipleOf' over more than 10000 integers",
    ),
    ({"type": "number", "multipleOf": 0.5}, "0.3", "'multipleOf' on a 'number'"),
    ({"type": "string", "format": "iri"}, '"x"', "'format' with the value 'iri'"),
    ({"type": "string", "pattern": "^a*$", "minLength": 2}, '"a"', "'minLength' next to 'pattern'"),
    ({"type": "string", "format": "date", "pattern": "^2024"}, '"2023-01-01"', "'pattern' next to 'format'"),
    # xgrammar's automaton for a pattern ignores a lookahead (it logs a warning).
    (
        {"type": "string", "pattern": "^(?!abc)[a-z]+$"},
        '"abcd"',
        "'pattern' with a lookahead ('(?=' or '(?!')",
    ),
    (
        {"type": "object", "patternProperties": {"^(?=x)[a-z]+$": INT}, "additionalProperties": False},
        '{"ab": 1}',
        "'patternProperties' with a lookahead ('(?=' or '(?!')",
    ),
    ({"minimum": 5}, "4", "'minimum' without a 'type'"),
    ({"required": ["a"]}, "{}", "'required' without a 'type'"),
    ({"type": "string", "enum": ["a", 1]}, "1", "'type' next to 'enum'"),
    ({"anyOf": [INT, STR], "minimum": 5}, "4", "'minimum' next to 'anyOf'"),
    (
        {"oneOf": [INT, {"type": "number"}]},
        "1",
        "'oneOf' with members 0 and 1, which can match the same value",
    ),
    ({"type": []}, '"x"', "'type' with no types"),
    (
        {"$ref": "http://example.com/s.json"},
        "1",
        "'$ref' with the reference 'http://example.com/s.json' (only '#' and '#/…' pointers are followed)",
    ),
    (
        {"type": "object", "properties": {"ab": STR}, "patternProperties": {"^a": INT}},
        '{"ab": "s"}',
        "'patternProperties' matching the declared property 'ab'",
    ),
    # Nested: the path says where.
    (
        {"type": "object", "properties": {"tags": {"type": "array", "items": STR, "uniqueItems": True}}},
        '{"tags": ["a", "a"]}',
        "'uniqueItems' at #/properties/tags",
    ),
    (
        {"$defs": {"s": STR}, "type": "object", "properties": {"x": {"$ref": "#/$defs/s", "maxLength": 1}}},
        '{"x": "ss"}',
        "'maxLength' next to '$ref' at #/properties/x",
    ),
    (
        {"$defs": {"T": {"type": "array", "items": INT, "uniqueItems": True}}, "$ref": "#/$defs/T"},
        "[1, 1]",
        "'uniqueItems' at #/$defs/T",
    ),
    ({"anyOf": [{"type": "null"}, {"type": "integer", "not": {"const": 3}}]}, "3", "'not' at #/anyOf/1"),
    (
        {"type": "array", "prefixItems": [{"type": "string", "format": "byte"}], "items": False},
        '["!"]',
        "'format' with the value 'byte' at #/prefixItems/0",
    ),
    (
        {"type": "array", "items": {"type": "integer", "multipleOf": 3, "minimum": 0}},
        "[4]",
        "'multipleOf' with a lower or an upper bound alone at #/items",
    ),
    (
        {"type": "object", "additionalProperties": {"type": "array", "items": INT, "uniqueItems": True}},
        '{"a": [1, 1]}',
        "'uniqueItems' at #/additionalProperties",
    ),
    (
        {"type": "object", "additionalProperties": INT, "propertyNames": {"format": "regex"}},
        '{"(": 1}',
        "'format' with the value 'regex' at #/propertyNames",
    ),
]


class Color(str, Enum):
    red = "red"
    green = "green"


class Cat(BaseModel):
    kind: Literal["cat"]
    lives: int = Field(default=9, ge=0, le=9)


class Dog(BaseModel):
    kind: Literal["dog"]
    name: str = Field(min_length=1, max_length=20)


class Pet(BaseModel):
    pet: Annotated[Cat | Dog, Field(discriminator="kind")]
    color: Color | None = None
    tags: list[str] = Field(default_factory=list, max_length=3)
    born: str = Field(json_schema_extra={"format": "date"})
    size: float | int = 1
    meta: dict[str, int] = {}


# (schema, JSON breaking it, which the grammar rejects): what structured outputs keep taking.
ALLOWED = [
    (Pet.model_json_schema(), '{"pet": {"kind": "cow"}, "born": "2024-01-01"}'),
    ({"type": "string", "enum": ["a", "b"]}, '"c"'),
    ({"const": "x", "type": "string", "description": "d"}, '"y"'),
    ({"enum": [5, 7], "minimum": 5, "type": "integer"}, "6"),
    ({"const": 2, "enum": [1, 2]}, "1"),
    ({"title": "P", "allOf": [{"$ref": "#/definitions/C"}], "default": 1, "definitions": {"C": INT}}, '"x"'),
    ({"anyOf": [INT, {"type": "null"}], "default": None, "title": "N"}, '"x"'),
    (
        {"type": "integer", "anyOf": [{"type": "integer", "minimum": 5}, {"type": "integer", "maximum": 1}]},
        "3",
    ),
    ({"type": "integer", "multipleOf": 7, "minimum": 0, "maximum": 100}, "8"),
    ({"type": "integer", "multipleOf": 7}, "8"),
    ({"type": "integer", "multipleOf": 0.5, "minimum": 0}, "-1"),
    ({"type": ["integer", "string"], "multipleOf": 7}, "8"),
    ({"type": "string", "format": "email"}, '"x"'),
    ({"type": "string", "pattern": "^a+$", "minLength": 0}, '"b"'),
    ({"type": "integer", "format": "int64", "minLength": 3}, '"x"'),  # string keywords on an integer
    ({"oneOf": [{"type": "string"}, {"type": "integer"}]}, "true"),
    ({"type": "array", "items": INT, "uniqueItems": False, "maxItems": 1}, "[1, 1]"),
    ({"type": "object", "patternProperties": {"^x": INT}, "properties": {"a": STR}}, '{"x": "s"}'),
    ({"type": "object", "additionalProperties": INT, "propertyNames": {"maxLength": 1}}, '{"ab": 1}'),
    ({"items": INT, "maxItems": 1}, "[1, 2]"),  # items make it an array
    ({"type": "string", "pattern": "^\\(?=[(?!]$"}, '"x"'),  # an escaped "(" and a class: no lookahead
    ({"type": "object", "properties": {"x": {"anyOf": [{"$ref": "#"}, INT]}}}, '{"x": "s"}'),
]


@pytest.fixture(scope="module")
def grammars(tiny_llama: Path) -> GrammarCompiler:
    tokenizer = Tokenizer.from_dir(tiny_llama)
    return GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)


def _accepts(schema: dict, text: str) -> bool:
    return _is_grammar_accept_string(Grammar.from_json_schema(json.dumps(schema), any_whitespace=True), text)


@pytest.mark.parametrize(("schema", "breaking", "refusal"), REFUSED)
def test_a_keyword_the_grammar_drops_is_refused(grammars, schema, breaking, refusal) -> None:
    message = f"structured outputs json uses the JSON Schema keyword {refusal}, which structured outputs cannot enforce"
    with pytest.raises(ValueError) as err:
        grammars.compile(SO(json=schema))
    assert str(err.value) == message
    assert grammars.cached(SO(json=schema)) is None
    assert _accepts(schema, breaking), "xgrammar enforces this now: allow it"


@pytest.mark.parametrize(("schema", "breaking"), ALLOWED)
def test_schemas_the_grammar_enforces_compile(grammars, schema, breaking) -> None:
    assert unenforced_keyword(schema) is None
    assert grammars.compile(SO(json=schema)) is not None
    assert not _accepts(schema, breaking)


def test_schemas_in_structural_tags_are_checked(grammars) -> None:
    schema = {"type": "object", "properties": {"x": {"type": "array", "items": STR, "uniqueItems": True}}}
    tail = "uses the JSON Schema keyword 'uniqueItems' at #/properties/x, which structured outputs cannot enforce"
    new = {
        "type": "structural_tag",
        "format": {
            "type": "tag",
            "begin": "<a>",
            "content": {"type": "json_schema", "json_schema": schema},
            "end": "</a>",
        },
    }
    old = {"structures": [{"begin": "<a>", "schema": schema, "end": "</a>"}], "triggers": ["<a"]}
    for tag in (new, old):
        with pytest.raises(ValueError) as err:
            grammars.compile(SO(structural_tag=tag))
        assert str(err.value) == f"structured outputs structural_tag {tail}"


@pytest.mark.parametrize(
    ("spec", "kind"), [(SO(grammar="root ::= root"), "grammar"), (SO(regex=r"[^\s\STR]"), "regex")]
)
def test_a_constraint_no_output_satisfies_is_refused(grammars, spec, kind) -> None:
    for _ in range(2):  # not cached: refused again
        with pytest.raises(ValueError) as err:
            grammars.compile(spec)
        assert str(err.value) == f"invalid structured outputs {kind}: no output of this model can satisfy it"
    # What only allows the end (an empty answer) is satisfiable.
    assert grammars.compile(SO(regex="")) is not None
