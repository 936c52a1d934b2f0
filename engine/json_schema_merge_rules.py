"""How two schemas' values of one keyword combine under ``allOf``: ``type``, ``enum`` and ``const``
intersected, bounds tightened, ``required`` united, ``multipleOf`` by least common multiple, and the
check that merged bounds still leave a value. These rules are stateless, one keyword pair at a
time; the walk over a schema, ``$ref`` resolution and ``anyOf`` distribution that apply them live in
``engine/json_schema_merge.py``. Torch- and xgrammar-free."""

from __future__ import annotations

from fractions import Fraction
from math import gcd, lcm
from typing import Any

from engine.json_schema_support import _FAMILY, _branch_types
from engine.json_schema_values import (
    Types,
    _applies,
    _same,
    _type_set,
    _value_type,
    _within,
    value_key,
)

# Keywords that constrain a value; any other (title, description, default, x-…) only annotates,
# and the first schema that has it gives its value.
_CONSTRAINTS = frozenset(_FAMILY) | {
    "type", "enum", "const", "not", "if", "then", "else", "anyOf", "oneOf", "allOf", "$ref",
    "additionalItems", "$dynamicRef", "$recursiveRef",
}  # fmt: skip
# Stay where they are (``$ref`` pointers are absolute): never copied out of a member.
_IN_PLACE = frozenset({"$defs", "definitions", "$id", "$schema", "$anchor"})
_TIGHTER = {
    **dict.fromkeys(("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties"), max),
    **dict.fromkeys(("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties"), min),
}
_BOUNDS = (  # (lower, upper, whether equal bounds leave nothing)
    ("minimum", "maximum", False),
    ("exclusiveMinimum", "maximum", True),
    ("minimum", "exclusiveMaximum", True),
    ("exclusiveMinimum", "exclusiveMaximum", True),
    ("minLength", "maxLength", False),
    ("minItems", "maxItems", False),
    ("minProperties", "maxProperties", False),
)
_OBJECT_KEYS = ("properties", "patternProperties", "additionalProperties", "unevaluatedProperties")
_ARRAY_KEYS = ("prefixItems", "items", "unevaluatedItems")
_GROUPED = frozenset({"type", "enum", "const", "required", *_OBJECT_KEYS, *_ARRAY_KEYS})


class _Unsatisfiable(Exception):
    """No JSON value satisfies the schemas being merged: why, and where."""

    def __init__(self, why: str, path: str) -> None:
        super().__init__(why)
        self.why, self.path = why, path


def _refusal(keyword: str, detail: str, path: str) -> ValueError:
    where = "" if path == "#" else f" at {path}"
    return ValueError(f"uses the JSON Schema keyword {keyword!r}{detail}{where}, which cannot be merged")


def _strip(node: Any) -> Any:
    if isinstance(node, dict) and any(k in node for k in _IN_PLACE):
        return {k: v for k, v in node.items() if k not in _IN_PLACE}
    return node


def _trivial(node: Any) -> bool:
    """Takes every JSON value (``true``, or only annotations)."""
    return node is True or (isinstance(node, dict) and not any(k in _CONSTRAINTS for k in node))


def _annotated(schema: Any, trivial: Any, a_first: bool) -> Any:
    """``schema`` with the annotations of a ``trivial`` one; where both have one, the first
    schema's (``schema`` when ``a_first``)."""
    notes = trivial if isinstance(trivial, dict) else {}
    if schema is True:
        return dict(notes) or True
    if not isinstance(schema, dict) or not notes:
        return schema
    if a_first:
        return {**schema, **{k: v for k, v in notes.items() if k not in schema}}
    return {**schema, **notes}


def _merge_values(a: dict, b: dict, out: dict, path: str) -> None:
    """``type``, ``enum`` and ``const`` of ``a`` and ``b``, intersected, into ``out``."""
    ta, tb = a.get("type"), b.get("type")
    if ta is not None and tb is not None:
        sa, sb = _type_set(ta), _type_set(tb)
        if sa is None or sb is None:
            if not _same(ta, tb):
                raise _refusal("type", " with different values in members of 'allOf'", path)
            out["type"] = ta
        else:
            common = [_common_type(t, sb) for t in ([ta] if isinstance(ta, str) else ta)]
            common = list(dict.fromkeys(t for t in common if t is not None))
            if not common:
                raise _Unsatisfiable(f"its members share no 'type' ({ta!r} and {tb!r})", path)
            out["type"] = common[0] if len(common) == 1 else common
    elif ta is not None or tb is not None:
        out["type"] = ta if ta is not None else tb
    va, vb = _allowed_values(a), _allowed_values(b)
    if va is None and vb is None:
        return
    if va is not None and vb is not None:
        in_b = {value_key(y) for y in vb}
        values = [x for x in va if value_key(x) in in_b]
    else:
        values = va if vb is None else vb
    declared = _type_set(out["type"]) if "type" in out else None
    if declared is not None:
        values = [v for v in values if _within(frozenset({_value_type(v)}), declared)]
    if not values:
        raise _Unsatisfiable("its members share no 'enum' or 'const' value", path)
    if len(values) == 1 and ("const" in a or "const" in b):
        out["const"] = values[0]
    else:
        out["enum"] = values


def _common_type(t: str, others: Types) -> str | None:
    """What of type ``t`` is also of one of ``others`` (an integer is a number)."""
    if t in others:
        return t
    return "integer" if {t} | ({"integer", "number"} & others) == {"integer", "number"} else None


def _allowed_values(node: dict) -> list[Any] | None:
    """The values ``const`` and ``enum`` together allow (None: no such keyword)."""
    values = node["enum"] if isinstance(node.get("enum"), list) else None
    if "const" in node:
        values = [node["const"]] if values is None or any(_same(node["const"], v) for v in values) else []
    return values


def _union(a: dict, b: dict, key: str, path: str) -> list[Any] | None:
    la, lb = a.get(key), b.get(key)
    if la is None or lb is None:
        return la if lb is None else lb
    if not isinstance(la, list) or not isinstance(lb, list):
        raise _refusal(key, " that is not a list, in 'allOf'", path)
    in_a = {value_key(x) for x in la}
    return la + [x for x in lb if value_key(x) not in in_a]


def _properties(node: dict, path: str) -> dict:
    props = node.get("properties", {})
    if not isinstance(props, dict):
        raise _refusal("properties", " that is not an object, in 'allOf'", path)
    return props


def _list(node: dict, key: str, path: str) -> list:
    value = node.get(key, [])
    if not isinstance(value, list):
        raise _refusal(key, " that is not a list, in 'allOf'", path)
    return value


def _additional(node: dict) -> Any:
    """What a property ``node`` does not declare must be (a node's own unevaluatedProperties is its
    additionalProperties, as xgrammar reads it: nothing beside it evaluates more)."""
    return node.get("additionalProperties", node.get("unevaluatedProperties", True))


def _rest_items(node: dict) -> Any:
    """What an item after ``node``'s prefixItems must be (unevaluatedItems read as items, likewise)."""
    return node.get("items", node.get("unevaluatedItems", True))


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _lcm(a: float, b: float) -> float:
    """The least common multiple of two positive numbers (of the decimals they are written as)."""
    fa, fb = Fraction(str(a)), Fraction(str(b))
    least = Fraction(lcm(fa.numerator, fb.numerator), gcd(fa.denominator, fb.denominator))
    return int(least) if least.denominator == 1 else float(least)


def _check_bounds(node: dict, path: str) -> None:
    """_Unsatisfiable when merged bounds leave no value of any of the node's types."""
    types = _branch_types(node, None)
    if not types:
        return
    for low, high, strict in _BOUNDS:
        lo, hi = node.get(low), node.get(high)
        if not (_number(lo) and _number(hi)) or not all(
            _applies(_FAMILY[low], frozenset({t})) for t in types
        ):
            continue
        if lo > hi or (strict and lo >= hi):
            raise _Unsatisfiable(f"{low!r} {lo} is above {high!r} {hi}", path)
    least = node.get("minItems")
    if types == {"array"} and node.get("items") is False and _number(least):
        if least > len(node.get("prefixItems") or ()):
            raise _Unsatisfiable(f"'minItems' {least} is more items than it allows", path)
