"""A JSON schema's ``pattern`` that xgrammar writes as grammar rules (one with a character beyond
ASCII, a quote, a backslash or a control character in it) matches the string's characters, not its
JSON text: as xgrammar writes it, ``"^\u00e9.$"`` took ``"\u00e9""`` and a raw newline, which are no
JSON. Its automaton matches the string's JSON text, writing what a JSON string holds only escaped
as an escape; xgrammar's own escapes (a format's) are left as they are."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import xgrammar as xgr

from engine.sampling_params import StructuredOutputsParams as SO
from engine.structured_output import GrammarCompiler
from engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def grammars(tiny_llama: Path) -> GrammarCompiler:
    tokenizer = Tokenizer.from_dir(tiny_llama)
    return GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)


def _complete(grammars: GrammarCompiler, compiled: xgr.CompiledGrammar, text: str) -> bool:
    """Whether the grammar takes ``text`` byte by byte (a token each: the tiny vocabulary is
    byte-level), then a stop token."""
    tokenizer = grammars._tokenizer
    by_byte = {tokenizer.token_bytes(t): t for t in range(grammars.vocab_size)}
    matcher = xgr.GrammarMatcher(compiled)
    return all(matcher.accept_token(by_byte[bytes([b])]) for b in text.encode()) and matcher.accept_token(
        grammars.stop_token_ids[0]
    )


_CASES = [
    # (schema, texts no JSON reader takes, texts it does and the schema allows)
    (
        {"type": "string", "pattern": "^\u00e9.$"},
        ['"\u00e9""', '"\u00e9\n"', '"\u00e9\\"'],
        ['"\u00e9a"', '"\u00e9\\""', '"\u00e9\\t"'],
    ),
    # What a JSON string holds only escaped is written escaped (tests/engine/test_pattern_escaped_json.py).
    ({"type": "string", "pattern": "^a\\n$"}, ['"a\n"'], ['"a\\n"']),
    ({"type": "string", "pattern": '^a"$'}, ['"a""'], ['"a\\""']),
    ({"type": "string", "pattern": "^a\\\\$"}, ['"a\\"'], ['"a\\\\"']),
    (
        {"type": "string", "pattern": "^\u00e9[^x]+$"},
        ['"\u00e9\x01"', '"\u00e9"b"'],
        ['"\u00e9ab"', '"\u00e9\u4e2d"', '"\u00e9\\u0001\\"b"'],
    ),
    (
        {
            "type": "object",
            "propertyNames": {"pattern": "^\u00e9.$"},
            "additionalProperties": {"type": "integer"},
        },
        ['{"\u00e9"": 1}'],
        ['{"\u00e9a": 1}'],
    ),
    # A format's own escapes (an email's quoted local part) are JSON already: left as they are.
    ({"type": "string", "format": "email"}, ['"a"b@c.de"'], ['"a.b@c.de"', '"\\"a b\\"@c.de"']),
    ({"type": "string", "format": "json-pointer"}, ['"/a"b"'], ['"/a/0"', '"/a\\"b"']),
]


@pytest.mark.parametrize(("schema", "invalid", "valid"), _CASES)
def test_a_pattern_writes_only_json(grammars, schema: dict, invalid: list[str], valid: list[str]) -> None:
    compiled = grammars.compile(SO(json=schema, disable_any_whitespace=True))
    for text in invalid:
        with pytest.raises(ValueError):
            json.loads(text)
        assert not _complete(grammars, compiled, text), text
    for text in valid:
        json.loads(text)
        assert _complete(grammars, compiled, text), text
