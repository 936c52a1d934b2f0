"""Grammars equivalent to the ones xgrammar (0.2.9) writes for a constraint, but valid JSON where
xgrammar's are not, or cheap to match where xgrammar's cost milliseconds a token.

The engine thread fills every constrained row's token mask each step, so a grammar's per-token
cost is paid by every request in the batch. Each rewrite here is of text xgrammar printed (or of a
regex), compiled by ``engine/structured_output.py`` in place of xgrammar's own; the measurements
are ``bench/grammar_cost.py``'s (a 20k-token vocabulary; costs grow with the vocabulary).

Pure functions of text; never imports xgrammar (nor torch).
"""

from __future__ import annotations

import json
import re

# The rule xgrammar writes for one character of a string with minLength / maxLength: it admits raw
# control characters (invalid JSON, which a strict parser refuses: mlc-ai/xgrammar#800) and no escape.
_BOUNDED_CHARACTER = re.compile(r'^(\S+) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.M)
# One unescaped character of a JSON string (no control character, quote or backslash): valid JSON,
# though a bounded string cannot write those (nor can xgrammar's own rule). Not JSON's whole
# character rule with its escapes: xgrammar matches a counted repetition of anything but one
# character class slowly, at every bound (5-19 ms a token for a string of maxLength 8 to 128, and
# growing with the position past 128; 0.02 ms with this class). Surrogates are left out: xgrammar
# takes their UTF-8 form (ED A0 80), which is no UTF-8, and decodes as three characters.
_PLAIN_CHARACTER = r"(([^\0-\x1f\"\\\ud800-\udfff]))"
# The character class xgrammar writes for a character of an unbounded JSON string (its
# "basic_string_sub"; json_object, any-typed values and property names use it too), matched outside
# string literals: it takes a surrogate's UTF-8 form (ED A0 80..ED BF BF), which is no UTF-8, so
# a byte-level vocabulary could write a string no strict reader decodes. Made ``_STRING_CLASS``:
# the same class without surrogates (the same cost a token: bench/grammar_cost.py).
_STRING_CLASS_XGR = r"[^\0-\x1f\"\\\r\n]"
_STRING_CLASS = r"[^\0-\x1f\"\\\r\n\ud800-\udfff]"
# A string literal or a character class of xgrammar's printed grammar (each skipped whole).
_LITERAL_OR_CLASS = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]')
# A repetition "rule{n, -1}" (at least n: a minItems, a minLength) as xgrammar prints it, matched
# outside string literals and character classes. Past n = 128 xgrammar expands it as
# "rule* rule{n-128} rule{128}": its parser then follows every way of splitting the items between
# the unbounded part and the counted ones, so each token costs in proportion to the position
# (minItems 10000: 2.2 ms a token by the 8000th item, and growing). "rule{n, n} rule*" is the same
# language, matched in constant time a token. (A rule of one character class is left as it is:
# xgrammar matches its "at least" cheaply already, and compiles "{n, n}" of it slowly: 0.5 s.)
_AT_LEAST = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|(?<![\w.-])([A-Za-z_][\w.-]*)\{(\d+), -1\}')
_AT_LEAST_EXPANDED_PAST = 128
_ONE_CLASS_RULE = re.compile(r"^(\S+) ::= \(\(\[(?:[^\]\\]|\\.)*\]\)\)$", re.M)


def json_grammar(text: str) -> str | None:
    """xgrammar's grammar ``text`` for a JSON schema (or a structural tag) with its bounded strings'
    character rule made ``_PLAIN_CHARACTER``, its unbounded strings' class ``_STRING_CLASS`` (no
    surrogates) and its long "at least" repetitions unambiguous (``_AT_LEAST``); None when it has
    none of them."""
    fixed = _BOUNDED_CHARACTER.sub(lambda m: f"{m.group(1)} ::= {_PLAIN_CHARACTER}", text)
    fixed = _LITERAL_OR_CLASS.sub(
        lambda m: _STRING_CLASS if m.group(0) == _STRING_CLASS_XGR else m.group(0), fixed
    )
    classes = set(_ONE_CLASS_RULE.findall(fixed))
    fixed = _AT_LEAST.sub(lambda m: _at_least(m, classes), fixed)
    return None if fixed == text else fixed


def regex_automaton(regex: str) -> str:
    """An EBNF grammar matching ``regex`` as an automaton: xgrammar's ``Regex("…")`` rule, the one
    it writes for a JSON schema's ``pattern``.

    ``compile_regex`` turns a regex into grammar rules that xgrammar's parser matches in every way
    a text can be split among them: ``(\\w+\\s?)+`` took 10-37 ms a token, ``(\\w|\\s){1,128}``
    7-15 ms, ``(\\w+\\s?){1,20}`` 240 ms; as an automaton, 0.002-0.01 ms. The regex is written
    unescaped (a character outside the basic plane written as two surrogate escapes would be two
    characters to xgrammar's reader)."""
    return f"root ::= Regex({json.dumps(regex, ensure_ascii=False)})"


def _at_least(m: re.Match[str], classes: set[str]) -> str:
    name, count = m.group(1), m.group(2)
    if name is None or name in classes or int(count) <= _AT_LEAST_EXPANDED_PAST:
        return m.group(0)
    return f"{name}{{{count}, {count}}} {name}*"
