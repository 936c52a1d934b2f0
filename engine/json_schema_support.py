"""Which parts of a JSON schema xgrammar compiles without enforcing.

xgrammar turns some schemas into grammars that accept JSON breaking one of their keywords (measured
with xgrammar 0.2.9; ``tests/engine/test_constraint_checks.py`` keeps the evidence). Structured
outputs refuse such a schema (``engine/structured_output.py``) rather than answer with output that
ignores part of it.

A schema node is read the way xgrammar reads it: the first of ``SHAPES`` it has makes its grammar,
and every other keyword beside it is dropped; else its ``type`` (without one, object or array
keywords make it that type), whose keywords apply; else it is any JSON value and they are all
dropped. A keyword only counts where it can constrain the output: a string keyword beside
``"type": "integer"`` constrains nothing for any validator either.

xgrammar enforces no ``allOf`` of more than one member (and drops the keywords beside one), so a
schema's ``allOf``s are merged before it is compiled (``engine/json_schema_merge.py``), and the
merged schema is the one checked. JSON equality, type sets and ``$ref`` pointers, which both read
schemas with, are ``engine/json_schema_values.py``.

Pure functions of decoded JSON; never imports xgrammar (nor torch).
"""

from __future__ import annotations

import contextlib
import re
from fractions import Fraction
from typing import Any

from engine.json_schema_values import (
    Types,
    _applies,
    _deref,
    _overlap,
    _resolve,
    _same,
    _type_set,
    _value_type,
    _within,
    value_key,
)

SHAPES = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")
_FAMILIES = {
    "number": "minimum maximum exclusiveMinimum exclusiveMaximum multipleOf",
    "string": "minLength maxLength pattern format",
    "array": "items prefixItems unevaluatedItems minItems maxItems uniqueItems contains",
    "object": "properties required additionalProperties unevaluatedProperties patternProperties "
    "propertyNames minProperties maxProperties dependentRequired dependentSchemas dependencies",
}
_FAMILY = {kw: family for family, kws in _FAMILIES.items() for kw in kws.split()}
# Never enforced, whatever the schema around them.
_NEVER = frozenset({"uniqueItems", "contains", "dependentRequired", "dependentSchemas", "dependencies"})
_OBJECT_HINTS = ("properties", "additionalProperties", "unevaluatedProperties")
_ARRAY_HINTS = ("items", "prefixItems", "unevaluatedItems")
# The string formats xgrammar has a grammar for; any other is not checked.
FORMATS = frozenset(
    "date time date-time duration email hostname ipv4 ipv6 uuid uri uri-reference uri-template "
    "json-pointer relative-json-pointer".split()
)
# An integer's multipleOf is enforced up to this value, with no bounds or over a closed range of at
# most this many integers.
_MULTIPLE_OF_MAX, _MULTIPLE_OF_RANGE_MAX = 1024, 10000

Problem = tuple[str, str]  # the keyword, why it is dropped ("" or " next to 'anyOf'", …)


def unenforced_keyword(schema: Any) -> str | None:
    """The first keyword of ``schema`` that its grammar would not enforce, as "uses the JSON Schema
    keyword 'K' … at PATH"; None when the grammar enforces every keyword. Walks what the grammar is
    made of: properties, items, members of anyOf / oneOf / allOf, local ``$ref`` targets."""
    seen: set[tuple[int, str | None]] = set()
    stack: list[tuple[Any, str, str | None]] = [(schema, "#", None)]
    while stack:
        node, path, default_type = stack.pop()
        if not isinstance(node, dict) or (id(node), default_type) in seen:
            continue
        seen.add((id(node), default_type))
        found = _node_problem(node, schema, default_type)
        if found is not None:
            where = "" if path == "#" else f" at {path}"
            return f"uses the JSON Schema keyword {found[0]!r}{found[1]}{where}"
        stack.extend(reversed(_children(node, path, default_type, schema)))
    return None


def _children(
    node: dict, path: str, default_type: str | None, root: Any
) -> list[tuple[Any, str, str | None]]:
    """The schemas the node's grammar is made of, with their paths (and default types: a
    ``propertyNames`` schema describes strings)."""
    shape = _shape(node)
    if shape == "$ref":
        target = _resolve(root, node["$ref"])
        return [] if target is None else [(target, node["$ref"], None)]
    if shape in ("anyOf", "oneOf", "allOf") and isinstance(node[shape], list):
        return [(m, f"{path}/{shape}/{i}", None) for i, m in enumerate(node[shape])]
    if shape is not None:
        return []
    types = _branch_types(node, default_type) or frozenset()
    out: list[tuple[Any, str, str | None]] = []
    if "object" in types:
        for key in ("properties", "patternProperties"):
            if isinstance(node.get(key), dict):
                out += [(v, f"{path}/{key}/{k}", None) for k, v in node[key].items()]
        extra = "additionalProperties" if "additionalProperties" in node else "unevaluatedProperties"
        out.append((node.get(extra), f"{path}/{extra}", None))
        out.append((node.get("propertyNames"), f"{path}/propertyNames", "string"))
    if "array" in types:
        if isinstance(node.get("prefixItems"), list):
            out += [(v, f"{path}/prefixItems/{i}", None) for i, v in enumerate(node["prefixItems"])]
        rest = "items" if "items" in node else "unevaluatedItems"
        out.append((node.get(rest), f"{path}/{rest}", None))
    return out


def _node_problem(node: dict, root: Any, default_type: str | None) -> Problem | None:
    """The first keyword of this node (not of the schemas inside it) that its grammar drops."""
    if "not" in node:
        return "not", ""
    if "if" in node and ("then" in node or "else" in node):
        return "if", ""
    for keyword in ("$dynamicRef", "$recursiveRef"):
        if keyword in node:
            return keyword, ""
    shape = _shape(node)
    if shape is not None:
        return _shape_problem(node, shape, root)
    types = _branch_types(node, default_type)
    for keyword in node:
        family = _FAMILY.get(keyword)
        if family is None or not _constrains(node, keyword):
            continue
        if types is None:
            return keyword, "" if keyword in _NEVER else " without a 'type'"
        if _applies(family, types):
            found = _keyword_problem(node, keyword, types)
            if found is not None:
                return found
    if types is not None and not types:
        return "type", " with no types"
    return None


def _keyword_problem(node: dict, keyword: str, types: Types) -> Problem | None:
    """What the grammar drops of ``keyword`` in a node of these ``types``."""
    if keyword in _NEVER:
        return keyword, ""
    if keyword == "multipleOf":
        return (keyword, " on a 'number'") if "number" in types else _integer_multiple(node)
    fmt = node.get("format")
    known_format = isinstance(fmt, str) and fmt in FORMATS
    if keyword == "format" and not known_format:
        return keyword, f" with the value {fmt!r}"
    if keyword in ("pattern", "minLength", "maxLength"):  # format, then pattern, then lengths
        if known_format:
            return keyword, " next to 'format'"
        if keyword != "pattern" and "pattern" in node:
            return keyword, " next to 'pattern'"
    if keyword in ("pattern", "patternProperties"):
        value = node[keyword]
        regexes = list(value) if isinstance(value, dict) else [value]
        if any(isinstance(r, str) and _has_lookahead(r) for r in regexes):
            return keyword, " with a lookahead ('(?=' or '(?!')"
    if keyword == "patternProperties" and isinstance(node.get("properties"), dict):
        for pattern in node["patternProperties"]:  # the declared property's schema alone applies
            for name in node["properties"]:
                with contextlib.suppress(re.error):
                    if re.search(pattern, name):
                        return keyword, f" matching the declared property {name!r}"
    return None


def _has_lookahead(regex: str) -> bool:
    """Whether ``regex`` has a lookahead, which xgrammar's automaton for a pattern ignores (it logs
    a warning and matches the rest). Escapes and character classes (JavaScript's: "[^]" is one)
    are skipped."""
    i = 0
    while i < len(regex):
        if regex[i] == "\\":
            i += 2
        elif regex[i] == "[":
            i += 2 if regex.startswith("^", i + 1) else 1
            while i < len(regex) and regex[i] != "]":
                i += 2 if regex[i] == "\\" else 1
            i += 1
        elif regex.startswith(("(?=", "(?!"), i):
            return True
        else:
            i += 1
    return False


def _integer_multiple(node: dict) -> Problem | None:
    step = node["multipleOf"]
    if step == 1 or isinstance(step, bool) or not isinstance(step, (int, float)):
        return None
    if step != int(step):  # every integer is a multiple of 1/k, which xgrammar drops rightly
        if (1 / Fraction(step)).denominator == 1:
            return None
        return "multipleOf", " with a value that is not a whole number, on an 'integer'"
    if step > _MULTIPLE_OF_MAX:
        return "multipleOf", f" with a value above {_MULTIPLE_OF_MAX}"
    low = [node[k] + d for k, d in (("minimum", 0), ("exclusiveMinimum", 1)) if k in node]
    high = [node[k] - d for k, d in (("maximum", 0), ("exclusiveMaximum", 1)) if k in node]
    if bool(low) != bool(high):
        return "multipleOf", " with a lower or an upper bound alone"
    if low and min(high) - max(low) + 1 > _MULTIPLE_OF_RANGE_MAX:
        return "multipleOf", f" over more than {_MULTIPLE_OF_RANGE_MAX} integers"
    return None


def _shape_problem(node: dict, shape: str, root: Any) -> Problem | None:
    """What the grammar drops in a node made by its ``shape`` keyword: what xgrammar approximates of
    the shape itself, and the keywords beside it that could constrain what it produces."""
    value = node[shape]
    if shape == "$ref" and isinstance(value, str) and value != "#" and not value.startswith("#/"):
        return "$ref", f" with the reference {value!r} (only '#' and '#/…' pointers are followed)"
    if shape == "allOf" and isinstance(value, list) and len(value) > 1:
        return "allOf", " with more than one schema"
    if shape == "oneOf" and isinstance(value, list):  # xgrammar writes it as anyOf
        members = [_Member(m, root) for m in value]  # once each: the pairs are many
        for i in range(len(members)):
            for j in range(i + 1, len(members)):
                if not _disjoint(members[i], members[j]):
                    return "oneOf", f" with members {i} and {j}, which can match the same value"
    values = _values(node)
    produced = _types({shape: value}, root) if values is None else frozenset(map(_value_type, values))
    for keyword, arg in node.items():
        if keyword == shape or not _constrains(node, keyword):
            continue
        if keyword == "type":
            allowed = _type_set(arg)
            ok = allowed is not None and produced is not None and _within(produced, allowed)
        elif keyword == "enum" and shape == "const":
            ok = isinstance(arg, list) and any(_same(value, v) for v in arg)
        elif keyword in SHAPES:
            ok = False
        elif keyword in _FAMILY:
            if values is not None:
                ok = all(_value_meets(v, keyword, arg) for v in values)
            else:
                ok = produced is not None and not _applies(_FAMILY[keyword], produced)
        else:
            continue
        if not ok:
            return keyword, f" next to {shape!r}"
    return None


def _shape(node: dict) -> str | None:
    return next((k for k in SHAPES if k in node), None)


def _constrains(node: dict, keyword: str) -> bool:
    """Whether the keyword's value constrains anything (``uniqueItems: false`` does not)."""
    value = node[keyword]
    if keyword == "uniqueItems":
        return value is True
    if keyword in ("minLength", "minItems", "minProperties"):
        return value != 0
    if keyword in ("required", "dependentRequired", "dependentSchemas", "dependencies"):
        return bool(value)
    return True


def _branch_types(node: dict, default_type: str | None) -> Types | None:
    """The types a node without a shape keyword takes (None: any JSON value)."""
    declared = node.get("type", default_type)
    if declared is not None:
        return _type_set(declared)
    if any(k in node for k in _OBJECT_HINTS):
        return frozenset({"object"})
    if any(k in node for k in _ARRAY_HINTS):
        return frozenset({"array"})
    return None


def _types(node: Any, root: Any, depth: int = 0) -> Types | None:
    """The JSON types a schema's grammar can produce (None: any, or not worked out)."""
    node = _deref(node, root)
    if not isinstance(node, dict) or depth > 64:
        return None
    values = _values(node)
    if values is not None:
        return frozenset(map(_value_type, values))
    shape = _shape(node)
    if shape in ("anyOf", "oneOf", "allOf") and isinstance(node[shape], list):
        if shape == "allOf" and len(node[shape]) != 1:
            return None
        found = [_types(m, root, depth + 1) for m in node[shape]]
        return None if any(t is None for t in found) else frozenset().union(*found)  # type: ignore[arg-type]
    return None if shape is not None else _branch_types(node, None)


def _values(node: Any) -> list[Any] | None:
    """The values a const or enum node allows (xgrammar reads const first)."""
    if not isinstance(node, dict) or _shape(node) not in ("const", "enum"):
        return None
    if "const" in node:
        return [node["const"]]
    return node["enum"] if isinstance(node["enum"], list) else None


def _value_meets(value: Any, keyword: str, arg: Any) -> bool:
    """Whether a const / enum value satisfies a keyword the grammar drops (False: not worked out)."""
    if not _applies(_FAMILY[keyword], frozenset({_value_type(value)})):
        return True  # the keyword is about values of another type
    checks = {
        "minimum": lambda: value >= arg,
        "maximum": lambda: value <= arg,
        "exclusiveMinimum": lambda: value > arg,
        "exclusiveMaximum": lambda: value < arg,
        "multipleOf": lambda: (Fraction(value) / Fraction(arg)).denominator == 1,
        "minLength": lambda: len(value) >= arg,
        "maxLength": lambda: len(value) <= arg,
        "pattern": lambda: re.search(arg, value) is not None,
    }
    try:
        return keyword in checks and bool(checks[keyword]())
    except (TypeError, ValueError, ZeroDivisionError, re.error):
        return False


class _Member:
    """What ``_disjoint`` reads of a schema, worked out once (a oneOf's members meet pairwise):
    the keys and types of its const / enum values, its types, and, for an object, the keys of the
    values of each property it requires that has const / enum values."""

    __slots__ = ("keys", "required_values", "types", "value_types")

    def __init__(self, schema: Any, root: Any) -> None:
        node = _deref(schema, root)
        values = _values(node)
        self.keys = None if values is None else frozenset(map(value_key, values))
        self.value_types = None if values is None else frozenset(map(_value_type, values))
        self.types = _types(node, root)
        self.required_values: dict[str, frozenset[Any]] = {}
        if self.types == frozenset({"object"}) and _shape(node) is None:
            props, required = node.get("properties"), node.get("required")
            if isinstance(props, dict) and isinstance(required, list):
                for key in required:
                    found = _values(_deref(props.get(key), root)) if isinstance(key, str) else None
                    if found is not None:
                        self.required_values[key] = frozenset(map(value_key, found))


def _disjoint(a: _Member, b: _Member) -> bool:
    """No JSON value matches both schemas, proved from their values, their types, or a property
    both require with disjoint const / enum values (a discriminator); False when not proved."""
    ta, tb = a.types, b.types
    if a.keys is not None and b.keys is not None:
        return a.keys.isdisjoint(b.keys)
    if a.value_types is not None and tb is not None:
        return not _overlap(a.value_types, tb)
    if b.value_types is not None and ta is not None:
        return not _overlap(b.value_types, ta)
    if ta is not None and tb is not None and not _overlap(ta, tb):
        return True
    return any(
        key in b.required_values and keys.isdisjoint(b.required_values[key])
        for key, keys in a.required_values.items()
    )
