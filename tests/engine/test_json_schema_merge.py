"""A JSON schema's ``allOf`` merged into one schema before xgrammar compiles it (xgrammar enforces no
``allOf`` of more than one member), and the string ``format``s structured outputs take.

Each merge is checked three ways: the exact merged schema; xgrammar, given the merged schema,
accepts JSON valid under the original and rejects JSON breaking one of its members (which it
accepts given the original: the merge is what enforces it); and the tiny model's output under a
merged schema is valid under the original schema, checked member by member by hand (the
``jsonschema`` package is not installed here).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from xgrammar import Grammar
from xgrammar.testing import _is_grammar_accept_string

from engine.json_schema_merge import merge_all_of
from engine.json_schema_support import FORMATS, unenforced_keyword
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.sampling_params import StructuredOutputsParams as SO
from engine.structured_output import GrammarCompiler
from engine.tokenizer import Tokenizer

INT, STR, NUM, NULL = {"type": "integer"}, {"type": "string"}, {"type": "number"}, {"type": "null"}

# (schema, its merge)
MERGED = [
    pytest.param(
        {
            "allOf": [
                {"type": "object", "properties": {"a": INT}, "required": ["a"]},
                {"type": "object", "properties": {"b": STR}, "required": ["b"]},
            ]
        },
        {"type": "object", "properties": {"a": INT, "b": STR}, "required": ["a", "b"]},
        id="objects: union of properties and of required",
    ),
    pytest.param(
        {
            "allOf": [
                {
                    "type": "object",
                    "properties": {
                        "n": {"type": "integer", "minimum": 0, "maximum": 100},
                        "c": {"enum": ["r", "g", "b"]},
                    },
                    "required": ["n"],
                },
                {
                    "properties": {
                        "n": {"type": "number", "minimum": 10, "exclusiveMaximum": 50},
                        "c": {"enum": ["g", "b", "k"]},
                    },
                    "required": ["c"],
                },
            ]
        },
        {
            "type": "object",
            "properties": {
                "n": {"type": "integer", "minimum": 10, "maximum": 100, "exclusiveMaximum": 50},
                "c": {"enum": ["g", "b"]},
            },
            "required": ["n", "c"],
        },
        id="a property both declare: its schemas merged",
    ),
    pytest.param(
        {
            "allOf": [
                {
                    "type": "object",
                    "properties": {"a": INT},
                    "additionalProperties": {"type": "integer", "minimum": 0},
                },
                {"type": "object", "properties": {"b": NUM, "c": STR}, "additionalProperties": False},
            ]
        },
        # a: not in the second member, so its additionalProperties (false) rules it out; b: the first
        # member's additionalProperties applies to it; c: a string no integer schema takes.
        {
            "type": "object",
            "properties": {"b": {"type": "integer", "minimum": 0}},
            "additionalProperties": False,
        },
        id="additionalProperties applies to what the other member declares",
    ),
    pytest.param(
        {
            "allOf": [
                {"type": "object", "properties": {"a": {}}},
                {"type": "object", "additionalProperties": False},
            ]
        },
        {"type": "object", "additionalProperties": False},
        id="a property another member closes out is left out",
    ),
    pytest.param(
        {"allOf": [{"type": "object", "properties": {"a": INT}}, {"required": ["b"]}]},
        {"type": "object", "properties": {"a": INT, "b": {}}, "required": ["b"]},
        id="a required name no member declares is declared",
    ),
    pytest.param(
        {
            "$defs": {"Base": {"type": "object", "properties": {"id": INT}, "required": ["id"]}},
            "title": "T",
            "allOf": [{"$ref": "#/$defs/Base"}, {"properties": {"name": STR}, "required": ["name"]}],
            "unevaluatedProperties": False,
        },
        {
            "$defs": {"Base": {"type": "object", "properties": {"id": INT}, "required": ["id"]}},
            "title": "T",
            "type": "object",
            "properties": {"id": INT, "name": STR},
            "required": ["id", "name"],
            "additionalProperties": False,
        },
        id="a $ref member, closed by unevaluatedProperties beside the allOf",
    ),
    pytest.param(
        {
            "$defs": {"N": {"type": "object", "properties": {"next": {"$ref": "#/$defs/N"}, "v": INT}}},
            "allOf": [{"$ref": "#/$defs/N"}, {"required": ["v"]}],
        },
        {
            "$defs": {"N": {"type": "object", "properties": {"next": {"$ref": "#/$defs/N"}, "v": INT}}},
            "type": "object",
            "properties": {"next": {"$ref": "#/$defs/N"}, "v": INT},
            "required": ["v"],
        },
        id="a recursive $ref stays a $ref",
    ),
    pytest.param(
        {"type": "object", "properties": {"x": {"allOf": [INT, {"minimum": 1}], "description": "d"}}},
        {"type": "object", "properties": {"x": {"description": "d", "type": "integer", "minimum": 1}}},
        id="nested, annotations kept",
    ),
    pytest.param(
        {"title": "P", "allOf": [{"$ref": "#/definitions/C"}], "default": 1, "definitions": {"C": INT}},
        {"title": "P", "default": 1, "definitions": {"C": INT}, "$ref": "#/definitions/C"},
        id="one member beside annotations only",
    ),
    pytest.param(
        {"allOf": [{"$ref": "#/$defs/P"}], "$defs": {"P": INT}, "minimum": 3},
        {"$defs": {"P": INT}, "minimum": 3, "type": "integer"},
        id="one member beside a keyword xgrammar would drop",
    ),
    pytest.param(
        {"allOf": [{"type": ["string", "integer", "null"]}, {"type": ["number", "null"]}]},
        {"type": ["integer", "null"]},
        id="type: intersection, an integer being a number",
    ),
    pytest.param(
        {"allOf": [{"enum": ["a", "b", 1]}, STR, {"const": "b"}]},
        {"type": "string", "const": "b"},
        id="enum and const: intersection, of the type",
    ),
    pytest.param(
        {"allOf": [{"type": "integer", "multipleOf": 4, "minimum": 0}, {"multipleOf": 6, "maximum": 100}]},
        {"type": "integer", "multipleOf": 12, "minimum": 0, "maximum": 100},
        id="multipleOf: least common multiple",
    ),
    pytest.param(
        {"allOf": [{"type": "string", "minLength": 2}, {"maxLength": 5, "minLength": 3}]},
        {"type": "string", "minLength": 3, "maxLength": 5},
        id="lengths: the tighter",
    ),
    pytest.param(
        {
            "allOf": [
                {"type": "array", "prefixItems": [INT, STR]},
                {"type": "array", "items": NUM, "maxItems": 3, "minItems": 1},
            ]
        },
        # item 1 must be a string and a number: the array ends before it.
        {"type": "array", "prefixItems": [INT], "items": False, "maxItems": 1, "minItems": 1},
        id="arrays: item by item",
    ),
    pytest.param(
        {
            "allOf": [
                {"type": "integer", "minimum": 10},
                {"anyOf": [{"type": "integer", "maximum": 5}, {"maximum": 20}, STR]},
            ]
        },
        {"type": "integer", "minimum": 10, "maximum": 20},
        id="anyOf: members no value fits are left out",
    ),
    pytest.param(
        {"allOf": [{"anyOf": [INT, STR]}, {"anyOf": [NUM, NULL, {"type": "string", "maxLength": 3}]}]},
        {"anyOf": [INT, {"type": "string", "maxLength": 3}]},
        id="anyOf and anyOf",
    ),
    pytest.param(
        {
            "allOf": [
                {"type": "object", "properties": {"id": INT}, "required": ["id"]},
                {
                    "oneOf": [
                        {"properties": {"kind": {"const": "a"}}, "required": ["kind"]},
                        {"properties": {"kind": {"const": "b"}, "x": STR}, "required": ["kind", "x"]},
                    ]
                },
            ]
        },
        {
            "oneOf": [
                {
                    "type": "object",
                    "properties": {"id": INT, "kind": {"const": "a"}},
                    "required": ["id", "kind"],
                },
                {
                    "type": "object",
                    "properties": {"id": INT, "kind": {"const": "b"}, "x": STR},
                    "required": ["id", "kind", "x"],
                },
            ]
        },
        id="oneOf: each member merged with the rest",
    ),
]


@pytest.mark.parametrize(("schema", "merged"), MERGED)
def test_allof_is_merged_into_one_schema(schema, merged) -> None:
    assert merge_all_of(schema) == merged
    assert unenforced_keyword(merged) is None  # and xgrammar enforces every keyword of it


def test_multiples_of_decimals_merge_to_their_least_common_multiple() -> None:
    # (xgrammar drops multipleOf on a number: the merged schema is refused then, as the unmerged one)
    for a, b, least in ((0.5, 0.75, 1.5), (0.1, 0.25, 0.5), (0.2, 3, 3), (1e-3, 0.4, 0.4)):
        schema = {"allOf": [{"type": "number", "multipleOf": a}, {"multipleOf": b}]}
        assert merge_all_of(schema) == {"type": "number", "multipleOf": least}


def _merged_case(name: str) -> dict:
    return next(p.values[0] for p in MERGED if p.id == name)


# (schema, JSON valid under it, JSON breaking one member): the merge keeps the one, drops the other.
ENFORCED = [
    ("objects: union of properties and of required", '{"a": 1, "b": "x"}', '{"a": 1}'),
    ("a property both declare: its schemas merged", '{"n": 10, "c": "g"}', '{"n": 50, "c": "g"}'),
    ("a property both declare: its schemas merged", '{"n": 49, "c": "b"}', '{"n": 20, "c": "r"}'),
    ("a required name no member declares is declared", '{"b": [true]}', '{"a": 1}'),
    (
        "a $ref member, closed by unevaluatedProperties beside the allOf",
        '{"id": 1, "name": "x"}',
        '{"id": 1, "name": "x", "z": 1}',
    ),
    ("enum and const: intersection, of the type", '"b"', '"a"'),
    ("multipleOf: least common multiple", "96", "8"),
    ("arrays: item by item", "[1]", '[1, "a"]'),
    ("anyOf: members no value fits are left out", "15", "5"),
    ("anyOf and anyOf", '"abc"', '"abcd"'),
    ("oneOf: each member merged with the rest", '{"id": 1, "kind": "b", "x": "s"}', '{"id": 1, "kind": "b"}'),
]


def _accepts(schema: object, text: str) -> bool:
    return _is_grammar_accept_string(Grammar.from_json_schema(json.dumps(schema), any_whitespace=True), text)


@pytest.mark.parametrize(("case", "valid", "breaking"), ENFORCED)
def test_the_merged_grammar_enforces_every_member(case, valid, breaking) -> None:
    schema = _merged_case(case)
    merged = merge_all_of(schema)
    assert _accepts(merged, valid)
    assert not _accepts(merged, breaking)
    assert _accepts(schema, breaking), "xgrammar enforces this allOf itself now"


# (schema, the refusal after "uses the JSON Schema keyword ")
UNMERGEABLE = [
    (
        {"allOf": [{"type": "string", "pattern": "^a"}, {"type": "string", "pattern": "b$"}]},
        "'pattern' with different values in members of 'allOf'",
    ),
    (
        {
            "type": "object",
            "properties": {"d": {"allOf": [{"type": "string", "format": "date"}, {"format": "email"}]}},
        },
        "'format' with different values in members of 'allOf' at #/properties/d",
    ),
    (
        {"allOf": [{"type": "object", "patternProperties": {"^x": INT}}, {"properties": {"a": INT}}]},
        "'patternProperties' beside another member's properties in 'allOf'",
    ),
    (
        {
            "allOf": [
                {"type": "object", "properties": {"a": {"type": "integer", "minimum": 5}}},
                {"properties": {"a": {"type": "integer", "maximum": 3}}},
            ]
        },
        "'properties' with a property 'a' that no value fits ('minimum' 5 is above 'maximum' 3)",
    ),
    (
        {"$defs": {"N": {"allOf": [{"$ref": "#/$defs/N"}, {"type": "object"}]}}, "$ref": "#/$defs/N"},
        "'$ref' that refers back to the 'allOf' around it at #/$defs/N",
    ),
    (
        {
            "type": "object",
            "properties": {"x": {"$ref": "#/allOf/0/properties/a"}},
            "allOf": [{"properties": {"a": INT}}],
        },
        "'$ref' with the reference '#/allOf/0/properties/a' into an 'allOf'",
    ),
    (
        {"allOf": [{"$ref": "https://example.com/a.json"}, {"type": "object"}]},
        "'$ref' with the reference 'https://example.com/a.json' (only '#' and '#/…' pointers are followed)",
    ),
]

# (schema, why no JSON value satisfies it)
UNSATISFIABLE = [
    ({"allOf": [STR, INT]}, "its members share no 'type' ('string' and 'integer')"),
    ({"allOf": [{"enum": [1, 2]}, {"enum": [3, 2.5]}]}, "its members share no 'enum' or 'const' value"),
    ({"allOf": [{"const": "a"}, INT]}, "its members share no 'enum' or 'const' value"),
    (
        {"allOf": [{"type": "integer", "minimum": 5}, {"exclusiveMaximum": 5}]},
        "'minimum' 5 is above 'exclusiveMaximum' 5",
    ),
    (
        {"allOf": [{"type": "string", "minLength": 4}, {"maxLength": 3}]},
        "'minLength' 4 is above 'maxLength' 3",
    ),
    ({"allOf": [INT, {"anyOf": [STR, NULL]}]}, "no member of its 'anyOf' fits the other schemas"),
    ({"allOf": [INT, False]}, "a member is the schema false"),
    (
        {
            "allOf": [
                {
                    "type": "object",
                    "properties": {"a": INT},
                    "required": ["a"],
                    "additionalProperties": False,
                },
                {"type": "object", "properties": {"b": INT}, "required": ["b"]},
            ]
        },
        "its members rule out the required property 'b' (a member's 'additionalProperties' is false)",
    ),
    (
        {
            "type": "object",
            "properties": {
                "p": {
                    "allOf": [
                        {"type": "object", "properties": {"q": STR}, "required": ["q"]},
                        {"properties": {"q": INT}},
                    ]
                }
            },
        },
        "its members rule out the required property 'q' (its members share no 'type' ('string' and 'integer'))"
        " at #/properties/p",
    ),
]


@pytest.fixture(scope="module")
def grammars(tiny_llama: Path) -> GrammarCompiler:
    tokenizer = Tokenizer.from_dir(tiny_llama)
    return GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)


@pytest.mark.parametrize(("schema", "refusal"), UNMERGEABLE)
def test_an_allof_that_cannot_be_merged_soundly_is_refused(grammars, schema, refusal) -> None:
    tail = f"uses the JSON Schema keyword {refusal}, which cannot be merged"
    with pytest.raises(ValueError) as err:
        merge_all_of(schema)
    assert str(err.value) == tail
    with pytest.raises(ValueError) as err:
        grammars.compile(SO(json=schema))
    assert str(err.value) == f"structured outputs json {tail}"
    assert grammars.cached(SO(json=schema)) is None


@pytest.mark.parametrize(("schema", "why"), UNSATISFIABLE)
def test_an_allof_no_value_satisfies_is_refused(grammars, schema, why) -> None:
    tail = f"has an 'allOf' that no JSON value satisfies: {why}"
    with pytest.raises(ValueError) as err:
        merge_all_of(schema)
    assert str(err.value) == tail
    with pytest.raises(ValueError) as err:
        grammars.compile(SO(json=schema))
    assert str(err.value) == f"structured outputs json {tail}"


def test_a_merged_schema_is_still_checked_for_what_xgrammar_drops(grammars) -> None:
    schema = {"allOf": [{"type": "string", "format": "date"}, {"pattern": "^2024"}]}
    with pytest.raises(ValueError) as err:
        grammars.compile(SO(json=schema))
    assert str(err.value) == (
        "structured outputs json uses the JSON Schema keyword 'pattern' next to 'format', "
        "which structured outputs cannot enforce"
    )


# --- string formats ------------------------------------------------------------------------------

# Every format xgrammar 0.2.9 has a grammar for (read from its json_schema_converter), with a value
# and a value breaking it.
ENFORCED_FORMATS = {
    "date": ("2024-01-31", "2024-13-01"),
    "time": ("12:34:56Z", "25:00:00Z"),
    "date-time": ("2024-01-31T12:34:56.5+05:30", "2024-01-31 12:34:56Z"),
    "duration": ("P3DT4H", "3D"),
    "email": ("a.b@c.org", "a@"),
    "hostname": ("a-1.example.com", "-a.com"),
    "ipv4": ("10.0.0.255", "256.1.1.1"),
    "ipv6": ("fe80::1", "1:2:3"),
    "uuid": ("123e4567-e89b-12d3-a456-426614174000", "123e4567e89b12d3a456426614174000"),
    "uri": ("https://a.com/x?y=1", "a b"),
    "uri-reference": ("../x#y", "%zz"),
    "uri-template": ("https://a.com/{x}", "{"),
    "json-pointer": ("/a/b~1c", "a/b"),
    "relative-json-pointer": ("0/a", "/a"),
}
# Formats xgrammar compiles as any string: a value breaking each.
IGNORED_FORMATS = {
    "iri": "x",
    "iri-reference": "a b",
    "idn-email": "x",
    "idn-hostname": "a b",
    "regex": "(",
    "byte": "!",
    "int64": "x",
}


def test_the_formats_taken_are_those_xgrammar_enforces() -> None:
    assert set(ENFORCED_FORMATS) == FORMATS


@pytest.mark.parametrize(("fmt", "valid", "breaking"), [(f, *v) for f, v in ENFORCED_FORMATS.items()])
def test_an_enforced_format_is_taken(grammars, fmt, valid, breaking) -> None:
    schema = {"type": "object", "properties": {"v": {"type": "string", "format": fmt}}, "required": ["v"]}
    assert grammars.compile(SO(json=schema)) is not None
    assert _accepts(schema, json.dumps({"v": valid}))
    assert not _accepts(schema, json.dumps({"v": breaking}))


@pytest.mark.parametrize(("fmt", "breaking"), IGNORED_FORMATS.items())
def test_a_format_xgrammar_ignores_is_refused(grammars, fmt, breaking) -> None:
    schema = {"type": "string", "format": fmt}
    with pytest.raises(ValueError) as err:
        grammars.compile(SO(json=schema))
    assert str(err.value) == (
        f"structured outputs json uses the JSON Schema keyword 'format' with the value {fmt!r}, "
        "which structured outputs cannot enforce"
    )
    assert _accepts(schema, json.dumps(breaking)), "xgrammar enforces this format now: take it"


# --- generation ----------------------------------------------------------------------------------

ORDER = {
    "$defs": {
        "Item": {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{1,4}$"},
                "qty": {"type": "integer", "minimum": 1},
            },
            "required": ["sku", "qty"],
            "additionalProperties": False,
        }
    },
    "allOf": [
        {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}},
            "required": ["id"],
        },
        {
            "properties": {
                "id": {"multipleOf": 5},
                "status": {"enum": ["new", "paid", "sent", "void"]},
                "item": {"$ref": "#/$defs/Item"},
            },
            "required": ["status", "item"],
        },
        {
            "properties": {
                "status": {"enum": ["paid", "sent", "lost"]},
                "item": {"properties": {"qty": {"maximum": 9}}},
            }
        },
    ],
    "unevaluatedProperties": False,
}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_order(text: str) -> None:
    """``text`` is valid under ORDER, read member by member."""
    value = json.loads(text)
    assert isinstance(value, dict)
    # allOf/0
    assert _is_int(value["id"]) and 0 <= value["id"] <= 999
    # allOf/1, with $defs/Item
    assert value["id"] % 5 == 0
    assert value["status"] in ("new", "paid", "sent", "void")
    item = value["item"]
    assert isinstance(item, dict) and set(item) == {"sku", "qty"}
    assert re.fullmatch("[A-Z]{2}[0-9]{1,4}", item["sku"])
    assert _is_int(item["qty"]) and item["qty"] >= 1
    # allOf/2
    assert value["status"] in ("paid", "sent", "lost")
    assert item["qty"] <= 9
    # unevaluatedProperties: nothing the members do not declare
    assert set(value) <= {"id", "status", "item"}


@pytest.fixture(scope="module")
def llm(tiny_llama):
    engine = LLM(str(tiny_llama), num_kv_blocks=256)
    yield engine
    engine.close()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generation_under_a_merged_allof_is_valid_under_the_original(llm, temperature) -> None:
    params = SamplingParams(
        max_tokens=120,
        temperature=temperature,
        seed=7,
        structured_outputs=SO(json=ORDER, disable_any_whitespace=True),
    )
    outs = llm.generate(["Hello world", "def f(x):", "import os", "class A:"], params)
    for out in outs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        _check_order(completion.text)


def test_generation_under_an_allof_no_value_satisfies_is_a_value_error(llm) -> None:
    params = SamplingParams(max_tokens=4, structured_outputs=SO(json={"allOf": [STR, INT]}))
    with pytest.raises(ValueError, match="has an 'allOf' that no JSON value satisfies"):
        llm.generate(["x"], params)
    assert not llm.engine.has_unfinished_requests()
