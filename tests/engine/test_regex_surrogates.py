"""A regex constraint, a JSON schema's ``pattern`` (a string's, a property name's), a structural
tag's regex and an EBNF grammar's classes never let a byte-level model write bytes that are no
UTF-8: a surrogate's form (ED A0 80..ED BF BF, U+D800..U+DFFF as CESU-8 writes them), which
xgrammar takes for "[^x]", "." or "\\S" (it matches by code point), or an overlong form
(E0 80 80..E0 9F BF, F0 80 80 80..F0 8F BF BF), which its regex automaton takes for a range
spanning two lengths of UTF-8 ("[^x]", ".", "[\\u0700-\\u0fff]"). The detokenizer writes U+FFFD for
them, and the text no longer matches the constraint. The tiny vocabulary is byte-level, so each
byte is fed as its own token, as a model could sample them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import xgrammar as xgr

from engine.grammar_rewrites import regex_utf8
from engine.sampling_params import StructuredOutputsParams as SO
from engine.structured_output import GrammarCompiler
from engine.tokenizer import Tokenizer

SURROGATES = (b"\xed\xa0\x80", b"\xed\xbf\xbf")  # U+D800, U+DFFF
OVERLONG = (
    b"\xe0\x80\x80",
    b"\xe0\x9f\xbf",
    b"\xf0\x80\x80\x80",
    b"\xf0\x8f\xbf\xbf",
)  # U+0000, U+07FF, U+0000, U+FFFF
NOT_UTF8 = SURROGATES + OVERLONG
# The characters around the surrogates, one beyond the basic plane and one of two bytes.
NEIGHBOURS = ("\ud7ff", "\ue000", "\U0010ffff", "\u00e9")


@pytest.fixture(scope="module")
def grammars(tiny_llama: Path) -> GrammarCompiler:
    tokenizer = Tokenizer.from_dir(tiny_llama)
    return GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)


def _walk(
    grammars: GrammarCompiler, compiled: xgr.CompiledGrammar, data: bytes, end: bool = False
) -> int | None:
    """Feed ``data`` a byte a token (then a stop token when ``end``); the index of the first one
    refused (``len(data)`` for the stop token), or None when all were taken."""
    tokenizer = grammars._tokenizer
    by_byte = {tokenizer.token_bytes(t): t for t in range(grammars.vocab_size)}
    matcher = xgr.GrammarMatcher(compiled)
    for i, byte in enumerate(data):
        if not matcher.accept_token(by_byte[bytes([byte])]):
            return i
    if end and not matcher.accept_token(grammars.stop_token_ids[0]):
        return len(data)
    return None


def _refuses_what_is_no_utf8(grammars: GrammarCompiler, compiled: xgr.CompiledGrammar, head: bytes) -> None:
    """After ``head`` (taken), each of ``NOT_UTF8`` is refused at its first byte or its second
    (E0, F0 and ED also lead characters)."""
    for bad in NOT_UTF8:
        refused = _walk(grammars, compiled, head + bad)
        assert refused is not None and len(head) <= refused <= len(head) + 1, bad


_ALL = "a\u00e9\ud7ff\ue000\U0010ffff"  # around the surrogates and each length of UTF-8


@pytest.mark.parametrize(
    ("regex", "text"),
    [
        ("[^x]+", _ALL),
        (".+", _ALL),
        ("\\S+", _ALL),
        ("\\W+", _ALL[1:]),  # (xgrammar's "\\w" is ASCII's)
        ("\\D+", _ALL),
        ("[\\s\\S]+", _ALL),
        ("[^\\n]+", _ALL),
        ("[^]+", _ALL),
        ("(a|[^b])+", _ALL),
        ("[a-\\uffff]+", _ALL[:-1]),
        ("[\\u0700-\\u0fff]+", "\u0700\u07ff\u0800\u0fff"),  # a range across two lengths of UTF-8
        ("[^\\u0080-\\u07ff]+", "a\ud7ff\ue000\U0010ffff"),
    ],
)
def test_a_regex_writes_only_utf8(grammars, regex: str, text: str) -> None:
    compiled = grammars.compile(SO(regex=regex))
    _refuses_what_is_no_utf8(grammars, compiled, text[0].encode())
    assert _walk(grammars, compiled, text.encode(), end=True) is None


_PATTERNS = {
    # A pattern xgrammar matches as a regex inside the string.
    "string": ({"type": "string", "pattern": "^[^x]+$"}, b'"', b'"'),
    "string, any character": ({"type": "string", "pattern": "^.+$"}, b'"', b'"'),
    # One with a character beyond ASCII: xgrammar writes it as grammar rules, "." a class.
    "string, rules": ({"type": "string", "pattern": "^\u00e9.+$"}, '"\u00e9'.encode(), b'"'),
    "property name": ({"type": "object", "propertyNames": {"pattern": "^[^x]+$"}}, b'{"', b'": 1}'),
    "pattern property": (
        {"type": "object", "patternProperties": {"^.+$": {"type": "integer"}}, "additionalProperties": False},
        b'{"',
        b'": 1}',
    ),
}


@pytest.mark.parametrize("where", list(_PATTERNS))
def test_a_json_schema_pattern_writes_only_utf8(grammars, where: str) -> None:
    schema, head, tail = _PATTERNS[where]
    compiled = grammars.compile(SO(json=schema, disable_any_whitespace=True))
    _refuses_what_is_no_utf8(grammars, compiled, head + b"a")
    for char in NEIGHBOURS:
        assert _walk(grammars, compiled, head + ("a" + char).encode() + tail, end=True) is None


def test_a_structural_tags_regex_writes_only_utf8(grammars) -> None:
    tag = {"type": "structural_tag", "format": {"type": "regex", "pattern": "[^x]+"}}
    compiled = grammars.compile(SO(structural_tag=json.dumps(tag)))
    _refuses_what_is_no_utf8(grammars, compiled, b"a")
    assert _walk(grammars, compiled, "a\U0010ffff".encode()) is None


@pytest.mark.parametrize(
    ("regex", "text", "ok"),
    [
        ("[^-a]+", "b", True),  # a negated class starting with "-": the "-" is still a character
        ("[^-a]+", "-", False),
        ("[^a-]+", "-", False),
        ("[^]", "\n", True),  # JavaScript's "any character"
        ("[\\s\\S]", " ", True),
        ("\\W", "a", False),
        ("\\D", "1", False),
        ("\\ud83d\\ude00", "\U0001f600", True),  # an escaped pair is one character, as in JavaScript
        ("a|\\ud800", "a", True),  # a lone surrogate matches nothing
    ],
)
def test_other_text_matches_as_before(grammars, regex: str, text: str, ok: bool) -> None:
    compiled = grammars.compile(SO(regex=regex))
    assert (_walk(grammars, compiled, text.encode(), end=True) is None) is ok


def _not(body: str) -> str:
    """The negated class of ``body``, one class for each length of UTF-8 (no surrogates)."""
    outside = ("\\u{80}-\\u{10ffff}", "\\u{0}-\\u{7f}\\u{800}-\\u{10ffff}",
               "\\u{0}-\\u{7ff}\\u{d800}-\\u{dfff}\\u{10000}-\\u{10ffff}", "\\u{0}-\\u{ffff}")  # fmt: skip
    return "(?:" + "|".join(f"[^{o}{body}]" for o in outside) + ")"


@pytest.mark.parametrize(
    ("regex", "rewritten"),
    [
        ("[^x]+", _not("x") + "+"),
        ("a.b", "a" + _not("") + "b"),
        ("\\S", _not("\\s")),
        ("[^-a]", _not("\\-a")),  # the "-" still a character, not a range's
        ("[a\\S]", "(?:[\\u{61}]|" + _not("\\s") + ")"),
        ("[\\u0100-\\uffff]", "(?:[\\u{100}-\\u{7ff}]|[\\u{800}-\\u{d7ff}\\u{e000}-\\u{ffff}])"),
        ("[\\u0800-\\u0fff\\d\\s]", "[\\u0800-\\u0fff\\d\\s]"),  # no range across two lengths
        ("[\\u00e9-\\u0800\\s]", "(?:[\\u{e9}-\\u{7ff}]|[\\u{800}]|[\\s])"),
        ("[\\ud800-\\udfff]", "[^\\s\\S]"),
        ("\\ud83d\\ude00", "\U0001f600"),
        ("[a-z\\u00e9]\\d\\w\\s\\.(x|y){2}", "[a-z\\u00e9]\\d\\w\\s\\.(x|y){2}"),  # nothing to rewrite
    ],
)
def test_the_regex_rewritten(regex: str, rewritten: str) -> None:
    assert regex_utf8(regex) == rewritten


@pytest.mark.parametrize(
    "grammar",
    [
        "root ::= [^x]+",
        'root ::= "a" Regex("[^x]+")',
        'root ::= ("[" | "#") [^\\]]+  # a comment with a [ class and a " quote',
        "root ::= [\\0-\\U0010ffff]+",
    ],
)
def test_an_ebnf_grammar_writes_only_utf8(grammars, grammar: str) -> None:
    compiled = grammars.compile(SO(grammar=grammar))
    head = b"a" if "Regex" in grammar else b"[" if "#" in grammar else b""
    _refuses_what_is_no_utf8(grammars, compiled, head + b"a")
    for char in NEIGHBOURS:
        assert _walk(grammars, compiled, head + ("a" + char).encode(), end=True) is None


def test_a_regex_compiled_as_rules_writes_only_utf8(grammars) -> None:
    """A regex xgrammar's automaton does not read (an unmatched "]") is compiled as rules: as free
    of surrogates."""
    compiled = grammars.compile(SO(regex=".+]"))
    assert "Regex(" not in str(compiled.grammar)
    _refuses_what_is_no_utf8(grammars, compiled, b"a")
    assert _walk(grammars, compiled, "a\U0010ffff]".encode(), end=True) is None


@pytest.mark.parametrize(
    ("regex", "text", "ok"),
    [
        ("\\U0001f600{2}", "\U0001f600\U0001f600", True),  # as compile_regex and Python read it
        ("\\U0001f600{2}", "U0001f6000", False),  # as the automaton's reader alone would ("0{2}")
        ("\\\\U0001f600", "\\U0001f600", True),  # an escaped backslash, then the letter
        ("a\\U0000d800", "a", False),  # a surrogate however written
    ],
)
def test_a_regex_eight_digit_escape_is_one_character(grammars, regex: str, text: str, ok: bool) -> None:
    compiled = grammars.compile(SO(regex=regex))
    assert (_walk(grammars, compiled, text.encode(), end=True) is None) is ok
