"""JSON values and types as a schema speaks of them: JSON equality (``_same``: 1 equals 1.0, true
is not 1) and a hashable key that agrees with it (``value_key``), sets of type names and how they
nest (an integer is a number), and local ``$ref`` pointers followed into the root schema.

Both readers of a schema share this vocabulary: the check for what xgrammar would not enforce
(``engine/json_schema_support.py``) and the ``allOf`` merge (``engine/json_schema_merge.py``), so
it stands apart from either. Pure functions of decoded JSON; never imports xgrammar (nor torch).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

Types = frozenset[str]


def _type_set(declared: Any) -> Types | None:
    if isinstance(declared, str):
        return frozenset({declared})
    if isinstance(declared, list) and all(isinstance(t, str) for t in declared):
        return frozenset(declared)
    return None


def _applies(family: str, types: Types) -> bool:
    """A keyword of ``family`` constrains values of one of these types."""
    return family in types or (family == "number" and "integer" in types)


def _within(types: Types, allowed: Types) -> bool:
    return all(t in allowed or (t == "integer" and "number" in allowed) for t in types)


def _overlap(a: Types, b: Types) -> bool:
    return any(x == y or {x, y} <= {"integer", "number"} for x in a for y in b)


def _value_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "integer" if float(value).is_integer() else "number"
    return {str: "string", list: "array"}.get(type(value), "object")


def value_key(value: Any) -> Any:
    """A hashable key of a decoded JSON value under JSON equality (``_same``): equal values, and
    only they, have equal keys, so sets of values meet in linear time (an enum of thousands
    against another was a pairwise comparison: seconds of Python holding the GIL)."""
    if value is None:
        return ("null",)
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, (int, float)):
        return ("number", value)  # 1 and 1.0 are equal and hash alike
    if isinstance(value, str):
        return ("string", value)
    if isinstance(value, list):
        return ("array", tuple(value_key(v) for v in value))
    if isinstance(value, dict):
        return ("object", frozenset((k, value_key(v)) for k, v in value.items()))
    return ("other", repr(value))


def _same(a: Any, b: Any) -> bool:
    """JSON equality: 1 equals 1.0, true is not 1."""
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _deref(node: Any, root: Any) -> Any:
    """``node`` with its local ``$ref``s followed (as far as they resolve)."""
    seen: set[str] = set()
    while isinstance(node, dict) and isinstance(node.get("$ref"), str) and node["$ref"] not in seen:
        seen.add(node["$ref"])
        target = _resolve(root, node["$ref"])
        if target is None:
            return node
        node = target
    return node


def _resolve(root: Any, ref: Any) -> Any:
    """The schema a local JSON pointer (``#``, ``#/$defs/a``) names in ``root``; None if none."""
    if ref == "#":
        return root
    if not isinstance(ref, str) or not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        if not part:
            continue
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
