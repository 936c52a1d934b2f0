"""Limits on what a structured-output constraint may ask of xgrammar (0.2.9), so that no one
request's grammar costs the engine thread milliseconds a token, or the compiler many seconds.

The engine thread fills every constrained row's token mask each step: a grammar that takes
10 ms a token slows every request in the batch by as much. Past these limits xgrammar's costs
leave the microseconds (measured with ``bench/grammar_cost.py``, a 20k-token vocabulary; costs
grow with the vocabulary, ~6x for a 128k one; ARCHITECTURE.md has the table):

* a counted repetition ``{n}`` / ``{n,}`` / ``{n,m}`` in a regex (a ``regex`` constraint, a JSON
  schema's ``pattern`` or ``patternProperties``) of more than ``MAX_REPEAT``: xgrammar then matches
  it in a way that took 1-15 ms a token (``.{0,500}``: 10 ms; ``^[a-z]{250}$``: 1.2 ms), and up to
  seconds when its body can match a text in more than one way (``(\\w+\\s?){1,2000}``); nested
  counts multiply (``((\\w+ ){1,20}\\n){1,20}`` compiled for 23 s);
* an object with more than ``MAX_OPTIONAL_PROPERTIES`` properties it does not require: the
  compile time grows with about the cube of their number (64: 0.25 s, 128: 1.5 s, 192: 4 s; ~6x
  that at a 128k vocabulary): 128, not less, since schemas of ordinary tools and forms reach a
  hundred optional fields, which vLLM serves;
* an ``enum`` (or a ``choice``) whose values come to more than ``MAX_VALUES_TEXT`` characters:
  past about 100k every token of the value took 6-13 ms;
* an ``anyOf`` / ``oneOf`` of more than ``MAX_BRANCHES`` members: 20000 const members took 13 ms a
  token, and a ``oneOf``'s members are checked pairwise for overlap (0.8 s for 1024).

A constraint past one is refused (ValueError, a 400 naming the keyword and the limit) before it
is compiled. Pure functions of decoded JSON and text; never imports xgrammar (nor torch).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from typing import Any

MAX_REPEAT = 128
MAX_OPTIONAL_PROPERTIES = 128
MAX_VALUES_TEXT = 65536
MAX_BRANCHES = 1024

_COUNT = re.compile(r"\{(\d+)(?:,\s*(\d*))?\}")
# Keywords whose value is a schema, a list of schemas, or a name -> schema map.
_ONE = ("items", "additionalItems", "additionalProperties", "unevaluatedItems", "unevaluatedProperties",
        "propertyNames", "contains", "not", "if", "then", "else")  # fmt: skip
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def regex_problem(regex: str) -> str | None:
    """Why ``regex`` is refused (as "has the counted repetition …"), or None: a counted repetition
    past ``MAX_REPEAT``, nested ones multiplied."""
    reps = _repetitions(regex)
    for text, count, start, end in reps:
        total = count
        for _, outer, o_start, o_end in reps:
            if o_start <= start and end <= o_end and (o_start, o_end) != (start, end):
                total *= outer
        if total > MAX_REPEAT:
            inside = "" if total == count else f" inside another, {total} repetitions in all,"
            return (
                f"has the counted repetition {text!r}{inside} above the {MAX_REPEAT} that structured "
                "outputs take (xgrammar matches a longer one slowly); write '*' or '+' and bound "
                "the length with max_tokens"
            )
    return None


def schema_problem(schema: Any) -> str | None:
    """Why JSON schema ``schema`` is refused (as "has …"), or None."""
    for node, path in _schemas(schema):
        where = "" if path == "#" else f" at {path}"
        patterns = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
        if isinstance(node.get("patternProperties"), dict):
            patterns += list(node["patternProperties"])
        for pattern in patterns:
            found = regex_problem(pattern)
            if found is not None:
                return f"has the 'pattern' {pattern!r}{where}, which {found}"
        props = node.get("properties")
        if isinstance(props, dict):
            required = node.get("required") if isinstance(node.get("required"), list) else []
            optional = len(props.keys() - {r for r in required if isinstance(r, str)})
            if optional > MAX_OPTIONAL_PROPERTIES:
                return (
                    f"has {optional} optional properties{where}, above the {MAX_OPTIONAL_PROPERTIES} "
                    "that structured outputs take in one object (its compile time grows with the "
                    "cube of their number); list more of them in 'required'"
                )
        if isinstance(node.get("enum"), list):
            size = sum(len(json.dumps(v, ensure_ascii=False)) for v in node["enum"])
            if size > MAX_VALUES_TEXT:
                return f"has an 'enum'{where} {_too_long(size)}"
        for keyword in ("anyOf", "oneOf"):
            members = node.get(keyword)
            if isinstance(members, list) and len(members) > MAX_BRANCHES:
                return (
                    f"has an {keyword!r}{where} of {len(members)} schemas, above the {MAX_BRANCHES} "
                    "that structured outputs take"
                )
    return None


def choice_problem(choices: Sequence[str]) -> str | None:
    """Why a ``choice`` constraint is refused (as "is …"), or None."""
    size = sum(len(c) for c in choices)
    return None if size <= MAX_VALUES_TEXT else f"is a list {_too_long(size)}"


def _too_long(size: int) -> str:
    return (
        f"whose values come to {size} characters, above the {MAX_VALUES_TEXT} that structured outputs "
        "take (past them every token of the value costs milliseconds)"
    )


def _repetitions(regex: str) -> list[tuple[str, int, int, int]]:
    """Each counted repetition of ``regex``: its text, its count (the larger bound; the lower one
    of ``{n,}``), and the span of what it repeats. Escapes and character classes are skipped; a
    ``{`` that is no quantifier is a literal, as in the regex dialects xgrammar reads."""
    out: list[tuple[str, int, int, int]] = []
    groups: list[int] = []
    atom: tuple[int, int] | None = None  # what a quantifier here would repeat
    i, n = 0, len(regex)
    while i < n:
        c = regex[i]
        if c == "\\":
            atom, i = (i, i + 2), i + 2
        elif c == "[":
            j = i + 2 if regex.startswith("^", i + 1) else i + 1  # as in JavaScript, "[^]" is a class
            while j < n and regex[j] != "]":
                j += 2 if regex[j] == "\\" else 1
            atom, i = (i, j + 1), j + 1
        elif c == "(":
            groups.append(i)
            atom, i = None, i + 1
        elif c == ")":
            atom, i = (groups.pop() if groups else 0, i + 1), i + 1
        elif c == "{" and atom is not None and (m := _COUNT.match(regex, i)) is not None:
            low, high = int(m.group(1)), m.group(2)
            out.append((m.group(0), max(low, int(high)) if high else low, *atom))
            atom, i = None, m.end()
        elif c in "|*+?":
            atom, i = None, i + 1
        else:
            atom, i = (i, i + 1), i + 1
    return out


def _schemas(schema: Any) -> Iterator[tuple[dict, str]]:
    """Every schema object in ``schema`` (itself included), with its JSON pointer."""
    stack: list[tuple[Any, str]] = [(schema, "#")]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue
        yield node, path
        children: list[tuple[Any, str]] = []
        for key in _ONE:
            if isinstance(node.get(key), dict):
                children.append((node[key], f"{path}/{key}"))
        for key in _MANY:
            if isinstance(node.get(key), list):
                children += [(v, f"{path}/{key}/{i}") for i, v in enumerate(node[key])]
        for key in _NAMED:
            if isinstance(node.get(key), dict):
                children += [(v, f"{path}/{key}/{name}") for name, v in node[key].items()]
        stack.extend(reversed(children))
