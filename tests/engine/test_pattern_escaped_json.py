"""A JSON schema ``pattern`` whose matches hold a quote, a backslash or a control character: the
string's JSON text writes them escaped (``engine/grammar_pattern_json.py``), so the output is valid
JSON and its decoded value matches the pattern. Before, xgrammar's automaton wrote no escape at
all: such a pattern was refused (a 400), and ``[^,]`` or ``.`` could never write a quote."""

from __future__ import annotations

import json
import re

import pytest
import xgrammar as xgr

from engine.grammar_pattern_json import json_escape, json_text_regex
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.sampling_params import StructuredOutputsParams as SO

SEEDS = range(24)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    engine = LLM(str(tiny_llama), num_kv_blocks=512, max_num_seqs=24)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def escape_bias(llm) -> dict[int, float]:
    """A logit bias toward a quote, a backslash and the letters of escapes ("n", "u", "0"): the
    random model then writes escapes often, so the tests see the grammar write them."""
    ids = [llm.tokenizer.encode(c, add_special_tokens=False) for c in ('"', "\\", "n", "u", "0")]
    assert all(len(i) == 1 for i in ids)  # byte-level: each its own token
    return {i[0]: 4.0 for i in ids}


def _values(llm: LLM, schema: dict, bias: dict[int, float], max_tokens: int = 120) -> list[object]:
    """The decoded JSON values of one sample per seed (half of them biased toward escapes); each
    output must be complete, valid JSON."""
    params = [
        SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0,
            seed=seed,
            logit_bias=bias if seed % 2 else None,
            structured_outputs=SO(json=schema, disable_any_whitespace=True),
        )
        for seed in SEEDS
    ]
    values = []
    for out in llm.generate(["Hello world"] * len(params), params):
        text, reason = out.outputs[0].text, out.outputs[0].finish_reason
        assert reason == "stop", text
        values.append(json.loads(text))
    return values


# (pattern, characters one of which some sample's value must hold: escapes written, not avoided)
_STRING_CASES = [
    ('^say "[a-z]{1,8}"$', '"'),
    ("^[^,]{1,12}$", '"'),  # a negated class admits a quote and a backslash
    ("^[^,]{1,12}$", "\\"),
    ("^a\\\\b$", "\\"),
    ("^line1\\nline2$", "\n"),
    (".", None),  # any one character but a line break: escapes among them
    ('^[\\x00-\\x1f"\\\\]{1,4}$', None),  # nothing but escaped characters
    ("^\\S{1,6}$", '"\\'),
    ("^[ -~]{1,8}$", '"'),  # a range across the quote and the backslash
]


@pytest.mark.parametrize(("pattern", "held"), _STRING_CASES)
def test_a_pattern_needing_escapes_writes_json_whose_value_matches(llm, escape_bias, pattern, held) -> None:
    values = _values(llm, {"type": "string", "pattern": pattern}, escape_bias)
    for value in values:
        assert isinstance(value, str) and re.search(pattern, value), (pattern, value)
    if held is not None:
        assert any(c in v for v in values for c in held), (pattern, values)


def test_dot_leaves_out_line_breaks_and_the_rest_escaped(llm, escape_bias) -> None:
    values = _values(llm, {"type": "string", "pattern": "^.{1,6}$"}, escape_bias)
    assert all(re.fullmatch(".{1,6}", v) and "\r" not in v for v in values), values
    assert any(c in v for v in values for c in '"\\'), values


def test_a_property_pattern_and_a_property_name_pattern(llm, escape_bias) -> None:
    schema = {
        "type": "object",
        "properties": {"quote": {"type": "string", "pattern": '^"[^"]{0,6}"$'}},
        "required": ["quote"],
        "additionalProperties": False,
    }
    for value in _values(llm, schema, escape_bias):
        assert list(value) == ["quote"] and re.search('^"[^"]{0,6}"$', value["quote"]), value
    names = {
        "type": "object",
        "propertyNames": {"pattern": '^k"[0-9]$'},
        "additionalProperties": {"type": "boolean"},
        "minProperties": 1,
        "maxProperties": 1,
    }
    for value in _values(llm, names, escape_bias):
        assert all(re.search('^k"[0-9]$', k) for k in value) and len(value) == 1, value


# Exact translations: a literal becomes its escape; a class or "." that admits escaped characters
# becomes an alternation of itself without them and their escapes; the rest is as it came.
_TRANSLATIONS = [
    ("^[a-z]+$", "^[a-z]+$"),
    ('^say "[a-z]+"$', '^say (?:\\\\")[a-z]+(?:\\\\")$'),
    ("^a\\\\b$", "^a(?:\\\\\\\\)b$"),
    ("^line1\\nline2$", "^line1(?:\\\\n)line2$"),
    ("^\\x01$", "^(?:\\\\u0001)$"),
    ('^[a\\d"]$', '^(?:[a\\d]|\\\\")$'),
    ("^[ -~]$", '^(?:[\\u{20}-\\u{21}\\u{23}-\\u{5b}\\u{5d}-\\u{7e}]|\\\\["\\\\])$'),
    ('^[^\\x00-\\x1f"\\\\]$', '^[^\\x00-\\x1f"\\\\]$'),  # admits no escaped character
    ("\\s", "(?:[^\\S\\u{0}-\\u{1f}]|\\\\(?:[tnfr]|u000b))"),
    ("[^,]", '(?:[^"\\\\\\u{0}-\\u{1f},]|\\\\(?:[btnfr"\\\\]|u00(?:0[0-7be-f]|1[0-9a-f])))'),
    (".", '(?:[^"\\\\\\u{0}-\\u{1f}\\u{2028}\\u{2029}]|\\\\(?:[btf"\\\\]|u00(?:0[0-7be-f]|1[0-9a-f])))'),
]


@pytest.mark.parametrize(("pattern", "translated"), _TRANSLATIONS)
def test_the_translated_regex(pattern: str, translated: str) -> None:
    assert json_text_regex(pattern) == translated


def _python(regex: str) -> re.Pattern[str]:
    """A translated regex as Python reads it (its braced escapes as Python's)."""
    return re.compile(re.sub(r"\\u\{([0-9a-f]+)\}", lambda m: f"\\U{int(m.group(1), 16):08x}", regex))


@pytest.mark.parametrize("pattern", [p for p, _ in _STRING_CASES] + ["^[^\\s]{2}$", "^\\D\\W$", "^[\\s\\S]$"])
def test_a_value_matches_exactly_when_its_json_text_matches_the_translation(pattern: str) -> None:
    # Every string of up to two characters over an alphabet of escaped and plain ones ("." aside,
    # for which the translation also leaves out "\r", as ECMA-262 reads it).
    alphabet = ['"', "\\", "\n", "\r", "\t", "\x00", "\x1b", "\x0b", "a", "z", ",", " ", "~", "\u00e9"]
    texts = ["", *alphabet, *(a + b for a in alphabet for b in alphabet)]
    translated = _python(json_text_regex(pattern))
    for text in texts:
        expected = re.fullmatch(pattern, text) is not None and ("." not in pattern or "\r" not in text)
        found = translated.fullmatch(json.dumps(text, ensure_ascii=False)[1:-1]) is not None
        assert found == expected, (pattern, text)


def test_escapes_are_json_dumps_forms() -> None:
    for code in [*range(0x20), ord('"'), ord("\\")]:
        assert json_escape(code) == json.dumps(chr(code))[1:-1]


def test_a_pattern_with_inline_flags_that_needs_an_escape_is_a_clear_refusal(llm) -> None:
    with pytest.raises(ValueError, match="has inline flags and matches a quote"):
        llm.engine.grammars.compile(SO(json={"type": "string", "pattern": '(?i)^a"$'}))
    assert llm.engine.grammars.compile(SO(json={"type": "string", "pattern": "(?i)^ab$"})) is not None


def test_a_backreference_is_still_refused(llm) -> None:
    with pytest.raises(ValueError, match="invalid structured outputs json: .*[Bb]ackreference"):
        llm.engine.grammars.compile(SO(json={"type": "string", "pattern": '^(")\\1$'}))


def test_a_structural_tag_schema_pattern_is_matched_as_json_text(llm) -> None:
    grammars = llm.engine.grammars
    tag = {
        "structures": [{"begin": "<f>", "schema": {"type": "string", "pattern": '^a"$'}, "end": "</f>"}],
        "triggers": ["<f>"],
    }
    compiled = grammars.compile(SO(structural_tag=tag))
    by_byte = {grammars._tokenizer.token_bytes(t): t for t in range(grammars.vocab_size)}

    def takes(text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        return all(matcher.accept_token(by_byte[bytes([b])]) for b in text.encode())

    assert takes('x<f>"a\\""</f>')
    assert not takes('x<f>"a""')
