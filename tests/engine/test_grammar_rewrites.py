"""Where xgrammar's (0.2.9) own grammar for a constraint costs milliseconds a token, structured
outputs compile an equivalent one that does not (``engine/grammar_rewrites.py``; the costs are
``bench/grammar_cost.py``'s): a regex as an automaton, a JSON "at least n" repetition (minItems)
without the ambiguity xgrammar expands it with. Each is the same language: the tests check both
the grammar compiled and what it accepts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import xgrammar as xgr

from engine.grammar_rewrites import json_grammar
from engine.sampling_params import StructuredOutputsParams as SO
from engine.structured_output import GrammarCompiler
from engine.tokenizer import Tokenizer
from tests.engine.test_regex_surrogates import _walk

INT = {"type": "integer"}


@pytest.fixture(scope="module")
def grammars(tiny_llama: Path) -> GrammarCompiler:
    tokenizer = Tokenizer.from_dir(tiny_llama)
    return GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)


def _xgrammar_text(schema: dict) -> str:
    """xgrammar's grammar for ``schema``, as printed: the text ``json_grammar`` rewrites."""
    return str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))


def _accepts(grammars: GrammarCompiler, compiled: xgr.CompiledGrammar, text: str) -> bool:
    matcher = xgr.GrammarMatcher(compiled)
    return matcher.accept_string(text) and matcher.accept_token(grammars.stop_token_ids[0])


@pytest.mark.parametrize(
    ("regex", "text", "ok"),
    [
        ("(\\w+\\s?)+", "ab cd ", True),
        ("(\\w+\\s?)+", "ab  cd", False),
        ("([A-Z][a-z]* ?)+\\.", "The Quick Fox.", True),
        ("([A-Z][a-z]* ?)+\\.", "The quick fox.", False),
        ("(\\w|\\s){1,5}", "a b c", True),
        ("(\\w|\\s){1,5}", "a b cd", False),
        ("\\d{1,3}(\\.\\d{1,3}){3}", "192.168.0.1", True),
        ("\\d{1,3}(\\.\\d{1,3}){3}", "192.168.0", False),
        ('"[^"]*"', '"a b"', True),  # quotes and backslashes reach the automaton intact
        ('"[^"]*"', '"a"b"', False),
        ("a\\\\b\tc", "a\\b\tc", True),
        ("\\u00e9{2}", "\u00e9\u00e9", True),  # an escaped character of several bytes
        ("[^a]{2}", "\u4e2d\U0001f600", True),
        (".*", "any\nthing", True),
    ],
)
def test_a_regex_compiles_as_an_automaton(grammars, regex: str, text: str, ok: bool) -> None:
    """``compile_regex``'s rules took 2-200 ms a token for these when ambiguous (``(\\w+\\s?)+``:
    10 ms, a 20k-token vocabulary); the automaton takes microseconds."""
    compiled = grammars.compile(SO(regex=regex))
    assert str(compiled.grammar).startswith("root ::= Regex(")
    assert _accepts(grammars, compiled, text) is ok


@pytest.mark.parametrize(
    ("regex", "text", "ok"),
    [
        ("\U0001f600{2}", "\U0001f600\U0001f600", True),  # written unescaped: one character, not two
        ("\U0001f600{2}", "\U0001f600", False),
        ("(\u4e2d|\u6587){1,3}", "\u4e2d\u6587", True),
        ("[\U0001f600-\U0001f602]+", "\U0001f601\U0001f600", True),
    ],
)
def test_a_regex_of_characters_beyond_ascii_compiles_as_an_automaton(
    grammars, regex: str, text: str, ok: bool
) -> None:
    compiled = grammars.compile(SO(regex=regex))
    assert str(compiled.grammar).startswith("root ::= Regex(")
    assert _accepts(grammars, compiled, text) is ok


def test_a_regex_whose_automaton_does_not_build_compiles_as_rules(grammars) -> None:
    """xgrammar's two regex readers differ on a POSIX class: the automaton's refuses it, the
    rules' reads ``[[:alpha:]`` as a class and ``]+`` after it; the rules are what it always was."""
    compiled = grammars.compile(SO(regex="[[:alpha:]]+"))
    assert "Regex(" not in str(compiled.grammar)
    assert [_accepts(grammars, compiled, t) for t in ("a]]", "abc")] == [True, False]


@pytest.mark.parametrize(
    ("regex", "reason"),
    [
        ("a(?=b)b", "Lookahead is not supported yet."),  # the automaton alone would ignore it
        ("(a)\\1", "Backreference is not supported yet."),
        ("\\bword\\b", "Word boundary is not supported yet."),
    ],
)
def test_a_regex_xgrammar_cannot_match_is_refused_as_before(grammars, regex: str, reason: str) -> None:
    with pytest.raises(ValueError) as err:
        grammars.compile(SO(regex=regex))
    assert str(err.value).startswith("invalid structured outputs regex: Regex parsing error at position ")
    assert str(err.value).endswith(reason)


@pytest.mark.parametrize(("count", "ok"), [(299, False), (300, True), (450, True)])
def test_min_items_past_128_is_matched_unambiguously(grammars, count: int, ok: bool) -> None:
    """xgrammar expands ``items{299, -1}`` as ``items* items{171} items{128}``, which its parser
    splits every way (2.2 ms a token by the 8000th item of a minItems 10000, and growing); it is
    compiled as ``items{299, 299} items*``."""
    schema = {"type": "array", "items": INT, "minItems": 300}
    text = json_grammar(_xgrammar_text(schema))
    assert text is not None and "{299, 299} root_items*" in text and "{299, -1}" not in text
    compiled = grammars.compile(SO(json=schema, disable_any_whitespace=True))
    assert "repeat_inf" not in str(compiled.grammar)  # xgrammar's unbounded part, which came first
    assert _accepts(grammars, compiled, json.dumps(list(range(count)))) is ok


def test_min_length_and_literals_keep_their_at_least(grammars) -> None:
    """A string's "at least" is one character class, which xgrammar matches cheaply as it is; text
    that looks like a repetition inside a literal is the literal's."""
    schema = {
        "type": "object",
        "properties": {"s": {"type": "string", "minLength": 200}, "c": {"const": "root_items{999, -1}"}},
        "required": ["s", "c"],
    }
    text = json_grammar(_xgrammar_text(schema))
    assert (
        text is not None
        and "{200, -1}" in text
        and '"root_items{999, -1}' in text
        and "{999, 999}" not in text
    )
    compiled = grammars.compile(SO(json=schema, disable_any_whitespace=True))
    for length, ok in ((199, False), (200, True), (300, True)):
        value = {"s": "x" * length, "c": "root_items{999, -1}"}
        assert _accepts(grammars, compiled, json.dumps(value)) is ok


@pytest.mark.parametrize(
    ("schema", "text", "ok"),
    [
        # JSON equality: 1 and 1.0 are one value, true is not 1.
        ({"oneOf": [{"enum": [1, "a"]}, {"enum": [2.0, True]}]}, "true", True),
        ({"allOf": [{"enum": [1, True, "a"]}, {"enum": [1.0, "a", None]}]}, "1", True),
        ({"allOf": [{"enum": [1, True, "a"]}, {"enum": [1.0, "a", None]}]}, "true", False),
        ({"allOf": [{"enum": [1, True, "a"]}, {"enum": [1.0, "a", None]}]}, "null", False),
    ],
)
def test_values_meet_under_json_equality(grammars, schema: dict, text: str, ok: bool) -> None:
    """Enums are met as sets of values (was pairwise: a oneOf or allOf of two 3000-value enums took
    3 s of Python, holding the GIL the engine thread needs)."""
    assert _accepts(grammars, grammars.compile(SO(json=schema)), text) is ok


def test_a_one_of_whose_members_share_a_value_is_refused(grammars) -> None:
    schema = {"oneOf": [{"enum": list(range(3000))}, {"enum": [f"{i}" for i in range(3000)] + [2999.0]}]}
    with pytest.raises(ValueError) as err:
        grammars.compile(SO(json=schema))
    assert str(err.value) == (
        "structured outputs json uses the JSON Schema keyword 'oneOf' with members 0 and 1, which can "
        "match the same value, which structured outputs cannot enforce"
    )


_UNBOUNDED_STRINGS = {
    "string": (SO(json={"type": "string"}), b'"', b'"'),
    "json_object": (SO(json_object=True), b'{"k": "', b'"}'),
    "property name": (SO(json={"type": "object", "additionalProperties": INT}), b'{"', b'": 1}'),
    "structural tag": (
        SO(
            structural_tag={
                "structures": [{"begin": "<f>", "schema": {"type": "string"}, "end": "</f>"}],
                "triggers": ["<f>"],
            }
        ),
        b'<f>"',
        b'"</f>',
    ),
}


@pytest.mark.parametrize("where", list(_UNBOUNDED_STRINGS))
def test_an_unbounded_json_string_takes_no_surrogate(grammars, where: str) -> None:
    """xgrammar's class for a character of an unbounded JSON string takes the UTF-8 form of a
    surrogate (ED A0 80 is U+D800's), which is no UTF-8: a byte-level model could write a string no
    strict reader decodes. The class is compiled without surrogates; the characters around them,
    and those beyond the basic plane, are taken as before."""
    spec, head, tail = _UNBOUNDED_STRINGS[where]
    compiled = grammars.compile(spec)
    for surrogate in (b"\xed\xa0\x80", b"\xed\xbf\xbf"):  # U+D800, U+DFFF as CESU-8 would write them
        assert _walk(grammars, compiled, head + b"a" + surrogate) == len(head) + 2
    for char in ("\ud7ff", "\ue000", "\U0010ffff", "é"):
        assert _walk(grammars, compiled, head + ("a" + char).encode() + tail) is None
