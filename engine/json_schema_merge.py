"""``allOf``, merged into one schema before xgrammar compiles it (it enforces no ``allOf`` of more
than one member, and drops what stands beside one). ``merge_all_of`` is the entry point; what
cannot be merged soundly, or what no JSON value satisfies, is a ValueError (a 400)."""

from __future__ import annotations

from fractions import Fraction
from math import gcd, lcm
from typing import Any

from engine.json_schema_support import (
    _FAMILY,
    Types,
    _applies,
    _branch_types,
    _resolve,
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
# Where a schema holds schemas: maps of them, lists of them, one of them.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("prefixItems", "items", "anyOf", "oneOf", "allOf")
_SCHEMA_ONE = (
    "additionalProperties unevaluatedProperties propertyNames items unevaluatedItems additionalItems "
    "contains not if then else contentSchema".split()
)
_MAX_MERGES, _MAX_MERGE_DEPTH = 20000, 120


class _Unsatisfiable(Exception):
    """No JSON value satisfies the schemas being merged: why, and where."""

    def __init__(self, why: str, path: str) -> None:
        super().__init__(why)
        self.why, self.path = why, path


def merge_all_of(schema: Any) -> Any:
    """``schema`` with every ``allOf`` replaced by one schema that takes exactly the JSON all its
    members (and the keywords beside it) take, or less: xgrammar enforces no ``allOf`` of more than
    one schema, and drops what stands beside one.

    Objects take the union of ``properties`` (a property two members declare takes both schemas; one
    that only one declares takes the other's ``additionalProperties``) and of ``required``; ``type``,
    ``enum`` and ``const`` intersect; bounds take the tighter; ``anyOf`` / ``oneOf`` members are
    distributed over (a member no JSON satisfies is left out); local ``$ref`` members are resolved.
    ``unevaluatedProperties`` / ``unevaluatedItems`` beside an ``allOf`` close what its merge
    declares. ValueError, saying which keyword and where, when a keyword cannot be merged soundly
    (two different ``pattern``s, …) or when no JSON value satisfies the ``allOf``."""
    merger = _AllOfMerger(schema)
    try:
        merged = merger.transform(schema, "#")
    except RecursionError:
        raise _refusal("allOf", " nested too deeply", "#") from None
    merger.check_refs(merged)
    return merged


class _AllOfMerger:
    def __init__(self, root: Any) -> None:
        self.root = root
        self.done: dict[int, Any] = {}  # id of a schema in ``root`` → it, merged
        self.active: set[int] = set()
        self.merges = self.depth = 0

    def transform(self, node: Any, path: str) -> Any:
        """``node`` with its ``allOf`` merged, and those of the schemas inside it."""
        if not isinstance(node, dict):
            return node
        if id(node) in self.done:
            return self.done[id(node)]
        if id(node) in self.active:
            raise _refusal("$ref", " that refers back to the 'allOf' around it", path)
        self.active.add(id(node))
        out = {k: self._transform_value(k, v, path) for k, v in node.items()}
        if isinstance(out.get("allOf"), list) and out["allOf"]:
            out = self._merge_all_of(out, path)
        self.active.discard(id(node))
        self.done[id(node)] = out
        return out

    def _transform_value(self, key: str, value: Any, path: str) -> Any:
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            return {k: self.transform(v, f"{path}/{key}/{k}") for k, v in value.items()}
        if key in _SCHEMA_LISTS and isinstance(value, list):
            return [self.transform(v, f"{path}/{key}/{i}") for i, v in enumerate(value)]
        return self.transform(value, f"{path}/{key}") if key in _SCHEMA_ONE else value

    def _merge_all_of(self, node: dict, path: str) -> Any:
        kept = {k: v for k, v in node.items() if k not in _CONSTRAINTS}  # $defs stay here
        rest = {k: v for k, v in node.items() if k in _CONSTRAINTS and k != "allOf"}
        closing = {k: rest.pop(k) for k in ("unevaluatedProperties", "unevaluatedItems") if k in rest}
        try:
            merged: Any = rest
            for member in node["allOf"]:
                merged = self.merge(merged, member, path)
            for keyword, value in closing.items():
                merged = self._close(merged, keyword, value, path)
        except _Unsatisfiable as e:
            where = "" if e.path == "#" else f" at {e.path}"
            raise ValueError(f"has an 'allOf' that no JSON value satisfies: {e.why}{where}") from None
        if merged is True:
            return kept
        return {**kept, **{k: v for k, v in merged.items() if k not in kept}}

    def merge(self, a: Any, b: Any, path: str) -> Any:
        """One schema for ``a`` and ``b`` (allOf-free); _Unsatisfiable when none can be."""
        if a is False or b is False:
            raise _Unsatisfiable("a member is the schema false", path)
        a, b = _strip(a), _strip(b)
        if _trivial(b):
            return _annotated(a, b, a_first=True)
        if _trivial(a):
            return _annotated(b, a, a_first=False)
        self.merges += 1  # distributing anyOf over anyOf multiplies them: a bound on the work
        if self.merges > _MAX_MERGES:
            raise _refusal("allOf", f" whose merge takes more than {_MAX_MERGES} steps", path)
        if not isinstance(a, dict) or not isinstance(b, dict):
            raise _refusal("allOf", " with a member that is not a schema", path)
        self.depth += 1
        try:
            if self.depth > _MAX_MERGE_DEPTH:
                raise _refusal("allOf", " whose members nest (or refer to each other) too deeply", path)
            if "$ref" in a or "$ref" in b:
                return self.merge(self._inline(a, path), self._inline(b, path), path)
            for side, other, side_first in ((a, b, True), (b, a, False)):
                for keyword in ("anyOf", "oneOf"):
                    if isinstance(side.get(keyword), list):
                        return self._distribute(side, keyword, other, side_first, path)
            return self._merge_keywords(a, b, path)
        finally:
            self.depth -= 1

    def _inline(self, node: dict, path: str) -> Any:
        """``node`` with its ``$ref`` replaced by the (merged) schema it points to."""
        ref = node.get("$ref")
        if ref is None:
            return node
        target = _resolve(self.root, ref)
        if target is None:
            local = isinstance(ref, str) and ref.startswith("#")
            why = ", which names no schema in it" if local else " (only '#' and '#/…' pointers are followed)"
            raise _refusal("$ref", f" with the reference {ref!r}{why}", path)
        rest = {k: v for k, v in node.items() if k != "$ref"}
        return self.merge(rest, self.transform(target, str(ref)), path)

    def _distribute(self, side: dict, keyword: str, other: Any, side_first: bool, path: str) -> Any:
        """(rest and anyOf[x, y]) and other = anyOf[rest and x and other, rest and y and other]; the
        same for oneOf (exactly one x_i matches iff exactly one x_i-and-the-rest does)."""
        rest = {k: v for k, v in side.items() if k != keyword}
        branches = []
        for member in side[keyword]:
            try:
                one = self.merge(rest, member, path)
                branches.append(self.merge(one, other, path) if side_first else self.merge(other, one, path))
            except _Unsatisfiable:
                continue
        if not branches:
            raise _Unsatisfiable(f"no member of its {keyword!r} fits the other schemas", path)
        return branches[0] if len(branches) == 1 else {keyword: branches}

    def _merge_keywords(self, a: dict, b: dict, path: str) -> dict:
        out = {k: v for k, v in a.items() if k not in _GROUPED}
        for key, vb in b.items():
            if key in _GROUPED:
                continue
            if key not in out or key not in _CONSTRAINTS:  # annotations: the first schema's
                out.setdefault(key, vb)
                continue
            va = out[key]
            if _same(va, vb):
                continue
            if key in _TIGHTER and _number(va) and _number(vb):
                out[key] = _TIGHTER[key](va, vb)
            elif key == "multipleOf" and _number(va) and _number(vb) and va > 0 and vb > 0:
                out[key] = _lcm(va, vb)
            elif key == "uniqueItems" and isinstance(va, bool) and isinstance(vb, bool):
                out[key] = va or vb
            elif key == "propertyNames":
                out[key] = self._merge_or_false(va, vb, f"{path}/propertyNames")
            else:
                raise _refusal(key, " with different values in members of 'allOf'", path)
        _merge_values(a, b, out, path)
        self._merge_objects(a, b, out, path)
        self._merge_arrays(a, b, out, path)
        _check_bounds(out, path)
        return {k: out[k] for k in dict.fromkeys([*a, *b, *out]) if k in out}  # the members' order

    def _merge_or_false(self, a: Any, b: Any, path: str) -> Any:
        try:
            return self.merge(a, b, path)
        except _Unsatisfiable:
            return False

    def _merge_objects(self, a: dict, b: dict, out: dict, path: str) -> None:
        required = _union(a, b, "required", path)
        if required is not None:
            out["required"] = required
        if not any(k in a for k in _OBJECT_KEYS) or not any(k in b for k in _OBJECT_KEYS):
            source = a if any(k in a for k in _OBJECT_KEYS) else b
            out.update({k: source[k] for k in _OBJECT_KEYS if k in source})
        elif "patternProperties" in a or "patternProperties" in b:
            raise _refusal("patternProperties", " beside another member's properties in 'allOf'", path)
        else:
            props_a, props_b = _properties(a, path), _properties(b, path)
            extra_a, extra_b = _additional(a), _additional(b)
            props, dropped = {}, []
            for name in [*props_a, *(n for n in props_b if n not in props_a)]:
                sa, sb = props_a.get(name, extra_a), props_b.get(name, extra_b)
                try:
                    props[name] = self.merge(sa, sb, f"{path}/properties/{name}")
                except _Unsatisfiable as e:
                    closed = (sa is False and name not in props_a) or (sb is False and name not in props_b)
                    dropped.append((name, "a member's 'additionalProperties' is false" if closed else e.why))
            extra = self._merge_or_false(extra_a, extra_b, f"{path}/additionalProperties")
            for name, why in dropped:
                if name in (required or ()):
                    raise _Unsatisfiable(f"its members rule out the required property {name!r} ({why})", path)
            if dropped and extra is not False:  # JSON Schema cannot say "any name but this one" here
                name, why = dropped[0]
                raise _refusal("properties", f" with a property {name!r} that no value fits ({why})", path)
            out.pop("unevaluatedProperties", None)
            if props:
                out["properties"] = props
            if any(k in side for side in (a, b) for k in ("additionalProperties", "unevaluatedProperties")):
                out["additionalProperties"] = extra
        self._declare_required(out, path)

    def _declare_required(self, out: dict, path: str) -> None:
        """A required property no member declares gets the schema ``additionalProperties`` gives it:
        xgrammar drops a required name that ``properties`` lacks."""
        props = out.get("properties", {})
        if (
            "patternProperties" in out
            or not isinstance(out.get("required"), list)
            or not isinstance(props, dict)
        ):
            return
        extra = _additional(out)
        for name in out["required"]:
            if isinstance(name, str) and name not in props:
                if extra is False:
                    raise _Unsatisfiable(f"its members rule out the required property {name!r}", path)
                props = {**props, name: {} if extra is True else extra}
        if props:
            out["properties"] = props

    def _merge_arrays(self, a: dict, b: dict, out: dict, path: str) -> None:
        if not any(k in a for k in _ARRAY_KEYS) or not any(k in b for k in _ARRAY_KEYS):
            source = a if any(k in a for k in _ARRAY_KEYS) else b
            out.update({k: source[k] for k in _ARRAY_KEYS if k in source})
            return
        if any(isinstance(side.get("items"), list) for side in (a, b)):
            raise _refusal("items", " as a list of schemas, beside another member's items in 'allOf'", path)
        prefix_a, prefix_b = _list(a, "prefixItems", path), _list(b, "prefixItems", path)
        rest_a, rest_b = _rest_items(a), _rest_items(b)
        items = self._merge_or_false(rest_a, rest_b, f"{path}/items")
        prefix = []
        for i in range(max(len(prefix_a), len(prefix_b))):
            sa = prefix_a[i] if i < len(prefix_a) else rest_a
            sb = prefix_b[i] if i < len(prefix_b) else rest_b
            try:
                prefix.append(self.merge(sa, sb, f"{path}/prefixItems/{i}"))
            except _Unsatisfiable:  # no item fits here: the array ends before it
                items, most = False, out.get("maxItems")
                out["maxItems"] = min(most, i) if _number(most) else i
                break
        out.pop("unevaluatedItems", None)
        if prefix:
            out["prefixItems"] = prefix
        if items is False or any(k in side for side in (a, b) for k in ("items", "unevaluatedItems")):
            out["items"] = items

    def _close(self, node: Any, keyword: str, value: Any, path: str) -> Any:
        """``node`` under the ``unevaluatedProperties`` (or ``unevaluatedItems``) that stood beside
        the allOf it merges: it applies to what no member declared."""
        covering = "additionalProperties" if keyword == "unevaluatedProperties" else "items"
        if isinstance(node, dict) and "$ref" in node:
            node = self._inline(node, path)
        node = {} if node is True else node
        for shape in ("anyOf", "oneOf"):
            if isinstance(node.get(shape), list):
                rest = {k: v for k, v in node.items() if k != shape}
                if not _trivial(rest):  # what the rest declares is evaluated in each member
                    return self._close(self.merge(rest, {shape: node[shape]}, path), keyword, value, path)
                return {**node, shape: [self._close(m, keyword, value, path) for m in node[shape]]}
        if covering in node:  # every property (item) is evaluated there: nothing is left to close
            return node
        if keyword == "unevaluatedProperties" and "patternProperties" in node:
            raise _refusal(keyword, " beside an 'allOf' whose members have patternProperties", path)
        return {**node, covering: value}

    def check_refs(self, merged: Any) -> None:
        """ValueError for a ``$ref`` that pointed into an ``allOf`` member, which is gone."""
        stack, seen = [merged], set()
        while stack:
            node = stack.pop()
            if isinstance(node, list):
                stack.extend(node)
            if not isinstance(node, dict) or id(node) in seen:  # merged members share schemas
                continue
            seen.add(id(node))
            ref = node.get("$ref")
            if _resolve(self.root, ref) is not None and _resolve(merged, ref) is None:
                raise _refusal("$ref", f" with the reference {ref!r} into an 'allOf'", "#")
            for key, value in node.items():
                if key in _SCHEMA_MAPS and isinstance(value, dict):
                    stack.extend(value.values())
                elif key in _SCHEMA_LISTS or key in _SCHEMA_ONE:
                    stack.append(value)


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


def declare_required(schema: Any) -> Any:
    """``schema`` with each required property that an object's ``properties`` lacks declared there,
    with the schema its ``additionalProperties`` gives it: xgrammar drops a required name that
    ``properties`` lacks (its strict mode admits no other names either), so the output could lack
    it. ValueError when ``additionalProperties: false`` rules a required name out."""
    return _declared(schema, "#")


def _declared(node: Any, path: str) -> Any:
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key, value in node.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: _declared(v, f"{path}/{key}/{k}") for k, v in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [_declared(v, f"{path}/{key}/{i}") for i, v in enumerate(value)]
        elif key in _SCHEMA_ONE:
            out[key] = _declared(value, f"{path}/{key}")
    props = out.get("properties", {})
    if not _an_object(out) or not isinstance(out.get("required"), list) or not isinstance(props, dict):
        return out
    if "patternProperties" in out:
        return out
    extra = _additional(out)
    for name in out["required"]:
        if isinstance(name, str) and name not in props:
            if extra is False:
                where = "" if path == "#" else f" at {path}"
                raise ValueError(
                    f"requires the property {name!r}{where}, which its 'additionalProperties' rules out"
                )
            props = {**props, name: {} if extra is True else extra}
    if props:
        out["properties"] = props
    return out


def _an_object(node: dict) -> bool:
    """Whether xgrammar reads ``node`` as an object schema (its ``required`` applies)."""
    declared = node.get("type")
    if declared is None:
        return any(k in node for k in ("properties", "additionalProperties", "unevaluatedProperties"))
    return declared == "object" or declared == ["object"]
