"""A JSON schema's ``pattern`` (a regex over a string's decoded value) as a regex over the string's
JSON text: what xgrammar's automaton for that string is built from.

xgrammar (0.2.9) matches a pattern's automaton against the raw text between the string's quotes,
writing no character JSON escapes (``json_string=true``): ``^say "[a-z]+"$`` or ``^a\\\\b$`` had no
sentence, and ``[^,]`` could never write a quote. Here each character a JSON string holds only
escaped (a quote, a backslash, U+0000..U+001F) becomes its JSON escape, one canonical form each
(``\\"``, ``\\\\``, ``\\b \\f \\n \\r \\t``, ``\\u00XX`` otherwise, lowercase, as ``json.dumps``
writes them): a literal becomes its escape, and a class, ``.`` or shorthand that admits such
characters becomes an alternation of itself without them and the escapes of those it admits. A
negated class, ``.`` (neither line feed, carriage return, U+2028 nor U+2029, as both Python and
ECMA-262 read it) and ``\\S`` / ``\\D`` / ``\\W`` keep excluding what they exclude.

The regex is read as ``engine/grammar_rewrites.py`` reads one (``_atom``: as xgrammar does), and
what comes out goes through its ``regex_utf8`` as any pattern does. Pure functions of text.
"""

from __future__ import annotations

import re

from engine.grammar_rewrites import _NEGATED_SHORTHANDS, _NO_CHARACTER, _atom, _merged

# The characters a JSON string holds only escaped, and the escape each is written as.
ESCAPED = frozenset([*range(0x20), ord('"'), ord("\\")])
_SHORT_ESCAPES = {0x22: '"', 0x5C: "\\", 0x08: "b", 0x0C: "f", 0x0A: "n", 0x0D: "r", 0x09: "t"}
# The escaped characters each shorthand matches as xgrammar reads it ("\\s": tab..carriage return,
# not U+001C..U+001F as Python's does); "\\d" and "\\w" match none.
_SPACES = frozenset(range(0x09, 0x0E))
_SHORTHAND_ESCAPED = {"d": frozenset(), "w": frozenset(), "s": _SPACES, "D": ESCAPED, "W": ESCAPED}
_SHORTHAND_ESCAPED["S"] = ESCAPED - _SPACES
# A class body (between "[^" and "]") leaving out every escaped character.
_UNESCAPED = '"\\\\\\u{0}-\\u{1f}'
# What "." leaves out besides: the line terminators of ECMA-262 (Python's "." leaves out "\\n" only).
_DOT_EXCLUDES = frozenset({0x0A, 0x0D, 0x2028, 0x2029})
# An inline flag group ("(?i)", "(?s:…)"): "(?i)" would match "\\N" for "\\n", no JSON escape.
_INLINE_FLAGS = re.compile(r"\(\?[aiLmsux-]+[:)]")
# Escapes that are no character, left to xgrammar to read or refuse: word boundaries,
# backreferences, Unicode properties.
_NOT_CHARACTERS = frozenset("bBkpP123456789")


def json_escape(code: int) -> str:
    """The JSON text of escaped character ``code`` (one of ``ESCAPED``)."""
    return "\\" + _SHORT_ESCAPES[code] if code in _SHORT_ESCAPES else f"\\u{code:04x}"


def json_text_regex(regex: str) -> str:
    """``regex``, a pattern over a JSON string's value, as a regex over the string's JSON text (the
    module docstring); unchanged when nothing in it matches a character JSON escapes. ValueError
    for one with inline flags that needs an escape (a case-insensitive escape is no JSON)."""
    out: list[str] = []
    escapes = False  # whether an escape was written (a pair of surrogate escapes read as one is not)
    i, n = 0, len(regex)
    while i < n:
        c, start = regex[i], i
        if c == "[":
            text, i = _class(regex, i)
        elif c == ".":
            rest = "[^" + _UNESCAPED + "\\u{2028}\\u{2029}]"
            text, i = _either([rest], ESCAPED - _DOT_EXCLUDES), i + 1
        elif c == "\\" and i + 1 < n and regex[i + 1] in _SHORTHAND_ESCAPED:
            text, i = _shorthand(regex[i + 1]), i + 2
        elif c == "\\" and i + 1 < n and regex[i + 1] in _NOT_CHARACTERS:
            text, i = regex[i : i + 2], i + 2
        elif c == "\\" and i + 2 < n and regex[i + 1] == "c" and regex[i + 2].isalpha():
            text, i = _either([], {ord(regex[i + 2]) % 32}), i + 3  # "\cA": U+0001
        elif c == "\\":
            code, text, i = _atom(regex, i)
            text = _either([], {code}) if code in ESCAPED else text
        else:
            text, i = (_either([], {ord(c)}) if ord(c) in ESCAPED else c), i + 1
        escapes |= text != regex[start:i] and "\\\\" in text
        out.append(text)
    translated = "".join(out)
    if escapes and _INLINE_FLAGS.search(regex):
        raise ValueError(
            f"the pattern {regex!r} has inline flags and matches a quote, a backslash or a control "
            "character, which a JSON string writes escaped: structured outputs cannot match its "
            "escapes under those flags; write the pattern without them"
        )
    return translated


def _either(rest: list[str], admitted: set[int] | frozenset[int]) -> str:
    """A regex matching each of ``rest`` (classes of unescaped characters) and the JSON escape of
    each of ``admitted`` (escaped characters), as one group: "\\" and then the escape's tail."""
    options = list(rest)
    short = [_SHORT_ESCAPES[c] for c in sorted(admitted) if c in _SHORT_ESCAPES]
    long = [
        _hex_tail(high, [c & 0xF for c in admitted if c >> 4 == high and c not in _SHORT_ESCAPES])
        for high in (0, 1)
    ]
    long = [t for t in long if t]
    tails = (
        [f"[{''.join(_class_char(c) for c in short)}]" if len(short) > 1 else _class_char(short[0])]
        if short
        else []
    )
    tails += [f"u00(?:{'|'.join(long)})" if len(long) > 1 else f"u00{long[0]}"] if long else []
    if tails:
        options.append("\\\\" + (tails[0] if len(tails) == 1 else f"(?:{'|'.join(tails)})"))
    if not options:
        return _NO_CHARACTER
    return options[0] if len(options) == 1 and options[0].startswith("[") else f"(?:{'|'.join(options)})"


def _hex_tail(high: int, lows: list[int]) -> str:
    """The last two hex digits of the "\\u00XX" escapes of the characters ``high`` * 16 + each of
    ``lows``, as a regex: the digit ``high``, then a class of the low digits (ranges of runs)."""
    digits = "0123456789abcdef"
    runs: list[list[int]] = []
    for low in sorted(lows):
        if runs and low == runs[-1][-1] + 1 and low != 10:  # "9" and "a" are no range
            runs[-1].append(low)
        else:
            runs.append([low])
    text = "".join(digits[r[0]] if len(r) == 1 else f"{digits[r[0]]}-{digits[r[-1]]}" for r in runs)
    if not text:
        return ""
    return f"{high}{text}" if len(lows) == 1 else f"{high}[{text}]"


def _class_char(c: str) -> str:
    """Character ``c`` as it is written in a class (or alone) of the regex."""
    return "\\" + c if c in "\\]^-" else c


def _shorthand_rest(letter: str) -> str:
    """A class of what escaping shorthand ``\\letter`` matches less the escaped characters."""
    if letter == "s":
        return "[^\\S\\u{0}-\\u{1f}]"
    return f"[^{_UNESCAPED}\\{_NEGATED_SHORTHANDS[letter]}]"


def _shorthand(letter: str) -> str:
    """Shorthand ``\\letter`` outside a class: itself where it admits no escaped character, else
    itself without them, and their escapes."""
    admitted = _SHORTHAND_ESCAPED[letter]
    return _either([_shorthand_rest(letter)], admitted) if admitted else "\\" + letter


def _class(regex: str, start: int) -> tuple[str, int]:
    """The character class at ``regex[start]`` ("[") over JSON text, and where it ends. Read as
    ``grammar_rewrites._class_utf8`` reads one: the first unescaped "]" ends it; "a-b" a range."""
    i, n = start + 1, len(regex)
    negated = regex.startswith("^", i)
    i += negated
    body_start = i
    ranges: list[tuple[int, int]] = []
    shorthands: list[str] = []  # "s" for "\\s", "S" for "\\S"
    while i < n and regex[i] != "]":
        at = i
        code, _, i = _atom(regex, i)
        high = code
        if regex.startswith("-", i) and i + 1 < n and regex[i + 1] != "]":
            high, _, i = _atom(regex, i + 1)
        if code is None or high is None:
            if regex[at + 1 : i] in _SHORTHAND_ESCAPED:
                shorthands.append(regex[at + 1 : i])
            continue
        ranges.append((code, high))
    end = min(i + 1, n)
    matched = {c for c in ESCAPED if any(lo <= c <= hi for lo, hi in ranges)}
    for s in shorthands:
        matched |= _SHORTHAND_ESCAPED[s]
    if negated:
        admitted = ESCAPED - matched
        if not admitted:
            return regex[start:end], end
        body = regex[body_start:i]
        body = "\\" + body if body.startswith("-") else body
        return _either([f"[^{_UNESCAPED}{body}]"], admitted), end
    if not matched:
        return regex[start:end], end
    kept = "".join(_range_text(lo, hi) for lo, hi in _merged(_without_escaped(ranges)))
    kept += "".join(f"\\{s}" for s in shorthands if not _SHORTHAND_ESCAPED[s])
    rest = [f"[{kept}]"] if kept else []
    rest += [_shorthand_rest(s) for s in dict.fromkeys(shorthands) if _SHORTHAND_ESCAPED[s]]
    return _either(rest, matched), end


# The code points a JSON string holds unescaped, below U+0060 (past "\\", all do).
_UNESCAPED_SPANS = ((0x20, 0x21), (0x23, 0x5B), (0x5D, 0x10FFFF))


def _without_escaped(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` less the escaped characters."""
    return [
        (max(lo, a), min(hi, b)) for lo, hi in ranges for a, b in _UNESCAPED_SPANS if max(lo, a) <= min(hi, b)
    ]


def _range_text(lo: int, hi: int) -> str:
    """A range of a class, its ends written as braced escapes unless letters or digits."""

    def char(code: int) -> str:
        return chr(code) if chr(code).isascii() and chr(code).isalnum() else f"\\u{{{code:x}}}"

    return char(lo) if lo == hi else f"{char(lo)}-{char(hi)}"
