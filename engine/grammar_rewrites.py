"""Grammars equivalent to the ones xgrammar (0.2.9) writes for a constraint, but valid JSON and
UTF-8 where xgrammar's are not, or cheap to match where xgrammar's cost milliseconds a token.

The engine thread fills every constrained row's token mask each step, so a grammar's per-token
cost is paid by every request in the batch. Each rewrite here is of text xgrammar printed (or of a
regex), compiled by ``engine/structured_output.py`` in place of xgrammar's own; the measurements
are ``bench/grammar_cost.py``'s (a 20k-token vocabulary; costs grow with the vocabulary).

Pure functions of text; never imports xgrammar (nor torch).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from engine.structural_tag_schemas import map_tag_schemas

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
# Every character class of xgrammar's grammar for a JSON schema, and every regex in it (a
# ``pattern``'s ``Regex("…")``), is matched by code point and takes a surrogate's UTF-8 form
# (ED A0 80..ED BF BF), which is no UTF-8: a byte-level vocabulary could write a string no strict
# reader decodes (the class of an unbounded string's character, "[^\0-\x1f\"\\\r\n]", json_object's
# and property names' too; a ``pattern``'s "[^x]" or "."). Each class is compiled without
# surrogates, each regex as ``regex_utf8`` writes it (``_without_surrogates``; the same cost a
# token: bench/grammar_cost.py).
_CLASS_OR_REGEX = re.compile(r'Regex\("((?:[^"\\]|\\.)*)"|"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]')
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


def json_grammar(text: str, patterns: Sequence[str] = ()) -> str | None:
    """xgrammar's grammar ``text`` for a JSON schema (or a structural tag) with its bounded strings'
    character rule made ``_PLAIN_CHARACTER``, its character classes and regexes matching no
    surrogate (``_CLASS_OR_REGEX``) and its long "at least" repetitions unambiguous
    (``_AT_LEAST``); None when it has none of them. ``patterns``: those ``marked_patterns`` took
    out of the schema, as regexes over a string's JSON text (``grammar_pattern_json``), each put
    back where its mark's automaton is, without xgrammar's ``json_string`` (which keeps an
    automaton from writing any escape)."""
    fixed = _MARK_REGEX.sub(lambda m: _pattern(m, patterns), text)
    fixed = _BOUNDED_CHARACTER.sub(lambda m: f"{m.group(1)} ::= {_PLAIN_CHARACTER}", fixed)
    fixed = _CLASS_OR_REGEX.sub(_without_surrogates, fixed)
    classes = set(_ONE_CLASS_RULE.findall(fixed))
    fixed = _AT_LEAST.sub(lambda m: _at_least(m, classes), fixed)
    return None if fixed == text else fixed


def ebnf_grammar(text: str) -> str | None:
    """An EBNF grammar as xgrammar prints it (a ``grammar`` constraint's, read and printed: no
    comments) with its character classes and regexes matching no surrogate, as ``json_grammar``'s
    are; None when nothing in it could match one."""
    fixed = _CLASS_OR_REGEX.sub(_without_surrogates, text)
    return None if fixed == text else fixed


def regex_automaton(regex: str) -> str:
    """An EBNF grammar matching ``regex`` as an automaton: xgrammar's ``Regex("…")`` rule, the one
    it writes for a JSON schema's ``pattern``.

    ``compile_regex`` turns a regex into grammar rules that xgrammar's parser matches in every way
    a text can be split among them: ``(\\w+\\s?)+`` took 10-37 ms a token, ``(\\w|\\s){1,128}``
    7-15 ms, ``(\\w+\\s?){1,20}`` 240 ms; as an automaton, 0.002-0.01 ms. The regex is written
    unescaped (a character outside the basic plane written as two surrogate escapes would be two
    characters to xgrammar's reader), as one that writes only UTF-8 (``regex_utf8``), and
    "\\U0001f600" is written "\\u{1f600}": ``compile_regex`` (and Python) read it as one
    character, the automaton's reader as the letter U and eight digits."""
    regex = _HEX8_ESCAPE.sub(_braced, regex)
    return f"root ::= Regex({json.dumps(regex_utf8(regex), ensure_ascii=False)})"


# An escape of a regex; group 1 the code point of "\\U" and eight hex digits.
_HEX8_ESCAPE = re.compile(r"\\(?:U([0-9A-Fa-f]{8})|.)", re.S)


def _braced(m: re.Match[str]) -> str:
    code = int(m.group(1) or "110000", 16)
    return f"\\u{{{code:x}}}" if code <= 0x10FFFF else m.group(0)


def _without_surrogates(m: re.Match[str]) -> str:
    """A match of ``_CLASS_OR_REGEX`` in an EBNF grammar's text made to match no surrogate: a
    ``Regex("…")``'s regex, a character class; a string literal as it is."""
    text = m.group(0)
    if m.group(1) is not None:
        regex = regex_utf8(_ebnf_string(m.group(1)))
        return f"Regex({json.dumps(regex, ensure_ascii=False)}"
    if not text.startswith("[") or _SURROGATE_RANGE in text:  # (a class of ours already)
        return text
    return _class_utf8(text, 0, ebnf=True)[0]


_EBNF_ESCAPE = re.compile(r"\\(?:x([0-9A-Fa-f]{2})|u([0-9A-Fa-f]{4})|U([0-9A-Fa-f]{8})|(.))", re.S)
_EBNF_ESCAPED = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "0": "\0", "b": "\b"}


def _ebnf_string(body: str) -> str:
    """The text of an EBNF string literal whose inside (between its quotes) is ``body``, as xgrammar
    prints one: C escapes."""

    def char(m: re.Match[str]) -> str:
        code = m.group(1) or m.group(2) or m.group(3)
        return chr(int(code, 16)) if code else _EBNF_ESCAPED.get(m.group(4), m.group(4))

    return _EBNF_ESCAPE.sub(char, body)


def marked_patterns(schema: str) -> tuple[str, list[str]]:
    """JSON schema text ``schema`` with each regex in it (a string's ``pattern``, a
    ``patternProperties`` name) replaced by a mark, and the regexes, in the marks' order; as it
    came when it is not JSON (the compile says so). Its grammar's marks are put back by
    ``json_grammar``.

    xgrammar writes a pattern in one of two ways: as an automaton of the string's JSON text
    (``Regex("…", json_string=true)``, which writes no character a JSON string must escape), or, for
    one with a quote, a backslash, a control character or a raw character beyond ASCII in it, as
    grammar rules of its characters, with no JSON escaping: ``"^\u00e9.$"`` took ``"\u00e9""`` and
    a raw newline, which are no JSON. A mark is written the first way (letters and digits alone),
    and so, with it put back, is every pattern: as a regex over the string's JSON text
    (``engine/grammar_pattern_json.py``), which writes what JSON escapes as escapes."""
    try:
        decoded = json.loads(schema)
    except ValueError:
        return schema, []
    found: list[str] = []
    return json.dumps(_mark(decoded, found)), found


def marked_tag_patterns(tag: Any) -> tuple[Any, list[str]]:
    """A structural tag with the regexes of its JSON schemas marked, as ``marked_patterns`` marks a
    schema's (one count over all of them), and the regexes."""
    found: list[str] = []
    return map_tag_schemas(tag, lambda schema: _mark(schema, found)), found


# A pattern's mark (one xgrammar writes as an automaton), and the automaton it is written as.
_MARK = "ferrypattern{}mark"
_MARK_REGEX = re.compile(r'Regex\("ferrypattern(\d+)mark"(?:, json_string=true)?')
# Keywords whose value is no schema (a JSON value), and those that name schemas.
_VALUE_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
_SCHEMA_MAPS = frozenset({"properties", "$defs", "definitions", "dependentSchemas"})


def _mark(node: Any, found: list[str], schemas: bool = False) -> Any:
    """``node`` (a schema; with ``schemas``, a map of names to schemas) with its regexes marked."""

    def marked(regex: str) -> str:
        found.append(regex)
        return _MARK.format(len(found) - 1)

    if isinstance(node, list):
        return [_mark(item, found) for item in node]
    if not isinstance(node, dict):
        return node
    if schemas:
        return {name: _mark(schema, found) for name, schema in node.items()}
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "pattern" and isinstance(value, str):
            out[key] = marked(value)
        elif key == "patternProperties" and isinstance(value, dict):
            out[key] = {marked(name): _mark(schema, found) for name, schema in value.items()}
        elif key in _VALUE_KEYWORDS:
            out[key] = value
        else:
            out[key] = _mark(value, found, schemas=key in _SCHEMA_MAPS)
    return out


def _pattern(m: re.Match[str], patterns: Sequence[str]) -> str:
    index = int(m.group(1))
    if index >= len(patterns):
        return m.group(0)
    return f"Regex({json.dumps(patterns[index], ensure_ascii=False)}"


def _at_least(m: re.Match[str], classes: set[str]) -> str:
    name, count = m.group(1), m.group(2)
    if name is None or name in classes or int(count) <= _AT_LEAST_EXPANDED_PAST:
        return m.group(0)
    return f"{name}{{{count}, {count}}} {name}*"


# What a regex's "any character" pieces become, so that its automaton writes only UTF-8. xgrammar
# (0.2.9) matches a class, "." or "\S" by code point, and
# * writes U+D800..U+DFFF (surrogates, no characters) as ED A0 80..ED BF BF: no UTF-8, and in
#   classes of EBNF too ("\ud800-\udfff" in a class leaves them out, in both);
# * encodes a range of its regex automaton that spans two lengths of UTF-8 loosely: "[^a]", ".",
#   "[\u0700-\u0fff]" take the overlong E0 80 80..E0 9F BF and F0 80 80 80..F0 8F BF BF, which are
#   no UTF-8 either (EBNF's classes are exact); a class kept within one length is exact.
# The detokenizer reads such bytes as U+FFFD, and the text no longer matches the constraint. So
# each such piece is written as an alternation of classes, one for each length of UTF-8.
_SURROGATE_RANGE = "\\ud800-\\udfff"
_BANDS = ((0, 0x7F), (0x80, 0x7FF), (0x800, 0xFFFF), (0x10000, 0x10FFFF))  # 1..4 bytes of UTF-8
# What a negated class leaves out besides its own, for each length: the other lengths (and the
# surrogates).
_OUTSIDE_BAND = (
    "\\u{80}-\\u{10ffff}",
    "\\u{0}-\\u{7f}\\u{800}-\\u{10ffff}",
    "\\u{0}-\\u{7ff}\\u{d800}-\\u{dfff}\\u{10000}-\\u{10ffff}",
    "\\u{0}-\\u{ffff}",
)
_NO_CHARACTER = "[^\\s\\S]"  # what a surrogate alone (no pair) may match: nothing
_NEGATED_SHORTHANDS = {"D": "d", "W": "w", "S": "s"}
_CONTROL_ESCAPES = {"t": 9, "n": 10, "v": 11, "f": 12, "r": 13, "0": 0, "b": 8}
_HEX4 = re.compile(r"u([0-9A-Fa-f]{4})")
_HEX_BRACED = re.compile(r"u\{([0-9A-Fa-f]{1,6})\}")
_HEX2 = re.compile(r"x([0-9A-Fa-f]{2})")
_HEX8 = re.compile(r"U([0-9A-Fa-f]{8})")  # EBNF's (and ``compile_regex``'s, not the automaton's)
_NO_CHARACTER_EBNF = "[^\\0-\\U0010ffff]"  # EBNF has no "\\s"


def regex_utf8(regex: str) -> str:
    """``regex`` with each piece that could make its automaton write bytes that are no UTF-8 (a
    surrogate, an overlong form: see above) written so that it does not: ``.``, ``\\D`` /
    ``\\W`` / ``\\S``, negated classes, classes spanning two lengths of UTF-8 or the surrogates. A
    surrogate pair written as two escapes (``\\ud83d\\ude00``, as JSON Schema's ECMA-262 patterns
    write a character beyond the basic plane) becomes that character, and a lone surrogate matches
    nothing. Every character matches as before; the regex is unchanged where nothing in it could
    write such bytes."""
    out: list[str] = []
    i, n = 0, len(regex)
    while i < n:
        c = regex[i]
        if c == "[":
            text, i = _class_utf8(regex, i)
            out.append(text)
        elif c == ".":
            out.append(_negated(""))
            i += 1
        elif c == "\\" and i + 1 < n and regex[i + 1] in _NEGATED_SHORTHANDS:
            out.append(_negated(f"\\{_NEGATED_SHORTHANDS[regex[i + 1]]}"))
            i += 2
        elif c == "\\" or _is_surrogate(ord(c)):
            code, text, end = _atom(regex, i)
            out.append(_NO_CHARACTER if code is not None and _is_surrogate(code) else text)
            i = end
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _negated(body: str) -> str:
    """The negated class of ``body`` (a class's text, between "[^" and "]"), as one class for each
    length of UTF-8 (surrogates left out)."""
    body = "\\" + body if body.startswith("-") else body
    return "(?:" + "|".join(f"[^{outside}{body}]" for outside in _OUTSIDE_BAND) + ")"


def _escape(code: int, ebnf: bool) -> str:
    """``code`` as an escape of an EBNF class, or a regex's (braced: no digit after it is read
    as its own)."""
    if not ebnf:
        return f"\\u{{{code:x}}}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def _is_surrogate(code: int) -> bool:
    return 0xD800 <= code <= 0xDFFF


def _atom(regex: str, i: int) -> tuple[int | None, str, int]:
    """The character at ``regex[i]`` (one, or an escape): its code point (None for a shorthand
    like ``\\d`` or an escape whose value is not a character), its text, and where it ends. A pair
    of surrogate escapes is read as the one character they encode (its text: that character)."""
    if regex[i] != "\\":
        return ord(regex[i]), regex[i], i + 1
    if i + 1 >= len(regex):
        return None, "\\", i + 1
    c = regex[i + 1]
    if m := _HEX4.match(regex, i + 1):
        code, end = int(m.group(1), 16), m.end()
        low = _HEX4.match(regex, end + 1) if regex.startswith("\\", end) else None
        if 0xD800 <= code <= 0xDBFF and low and 0xDC00 <= int(low.group(1), 16) <= 0xDFFF:
            pair = 0x10000 + ((code - 0xD800) << 10) + int(low.group(1), 16) - 0xDC00
            return pair, chr(pair), low.end()
        return code, regex[i:end], end
    if (
        (m := _HEX_BRACED.match(regex, i + 1))
        or (m := _HEX2.match(regex, i + 1))
        or (m := _HEX8.match(regex, i + 1))
    ):
        return int(m.group(1), 16), regex[i : m.end()], m.end()
    if c in "dwsDWS":
        return None, regex[i : i + 2], i + 2
    return _CONTROL_ESCAPES.get(c, ord(c)), regex[i : i + 2], i + 2


def _class_utf8(regex: str, start: int, ebnf: bool = False) -> tuple[str, int]:
    """The character class at ``regex[start]`` ("[") written to match the same characters but no
    surrogate, as classes that each keep within one length of UTF-8 (``regex_utf8``), and where it
    ends. Read as xgrammar reads one: the first unescaped "]" ends it (``[]`` is empty); "a-b" a
    range. ``ebnf``: a class of an EBNF grammar, whose classes xgrammar encodes exactly but for
    the surrogates (no shorthands there, and no "\\s" to write one that matches nothing with)."""
    i, n = start + 1, len(regex)
    negated = regex.startswith("^", i)
    i += negated
    body_start = i
    ranges: list[tuple[int, int]] = []  # the class's characters (surrogates left out)
    texts: list[str] = []  # its items whose characters are not known here: shorthands
    negated_shorthands: list[str] = []  # "d" for "\\D"
    changed = False  # a surrogate, or a pair read as one character
    while i < n and regex[i] != "]":
        at = i
        code, _, i = _atom(regex, i)
        high, high_at = code, at
        if regex.startswith("-", i) and i + 1 < n and regex[i + 1] != "]":
            high_at = i + 1
            high, _, i = _atom(regex, high_at)
        if code is None or high is None:
            if regex[at + 1 : i] in _NEGATED_SHORTHANDS:
                negated_shorthands.append(_NEGATED_SHORTHANDS[regex[at + 1 : i]])
            else:
                texts.append(regex[at:i])
            continue
        changed |= (
            _is_pair(regex, at, code) or _is_pair(regex, high_at, high) or (code <= 0xDFFF and high >= 0xD800)
        )
        for low, top in ((code, min(high, 0xD7FF)), (max(code, 0xE000), high)):
            if low <= top:
                ranges.append((low, top))
    end = min(i + 1, n)
    if negated:
        body = regex[body_start:i]
        if ebnf:
            body = "\\" + body if body.startswith("-") else body
            return f"[^{_SURROGATE_RANGE}{body}]", end
        return _negated(body), end
    merged = _merged(ranges)
    if ebnf:  # exact but for the surrogates: one class
        if not changed:
            return regex[start:end], end
        pieces = "".join(_piece(lo, hi, ebnf) for lo, hi in merged) + "".join(texts)
        return (f"[{pieces}]" if pieces else _NO_CHARACTER_EBNF), end
    # A range across two lengths of UTF-8 holds both code points at a boundary (U+007F and U+0080,
    # U+07FF and U+0800, U+FFFF and U+10000); no shorthand ("\\d", "\\w", "\\s") holds one.
    spans = any(_band(lo) != _band(hi) for lo, hi in merged)
    if not (changed or negated_shorthands or spans):
        return regex[start:end], end
    options = []
    for b_lo, b_hi in _BANDS:
        band = [(max(lo, b_lo), min(hi, b_hi)) for lo, hi in merged if lo <= b_hi and hi >= b_lo]
        if band:
            options.append(f"[{''.join(_piece(lo, hi, False) for lo, hi in band)}]")
    options += [f"[{''.join(texts)}]"] if texts else []
    options += [_negated(f"\\{s}") for s in negated_shorthands]
    if not options:
        return _NO_CHARACTER, end
    return (options[0] if len(options) == 1 else f"(?:{'|'.join(options)})"), end


def _is_pair(regex: str, at: int, code: int) -> bool:
    """Whether the atom at ``regex[at]``, read as ``code``, is a surrogate pair written as two
    escapes (``_atom`` reads it as one character)."""
    return code > 0xFFFF and _HEX4.match(regex, at + 1) is not None


def _band(code: int) -> int:
    return next(i for i, (_, hi) in enumerate(_BANDS) if code <= hi)


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _piece(lo: int, hi: int, ebnf: bool) -> str:
    return _escape(lo, ebnf) if lo == hi else f"{_escape(lo, ebnf)}-{_escape(hi, ebnf)}"
