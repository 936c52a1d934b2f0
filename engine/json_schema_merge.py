"""``allOf``, merged into one schema before xgrammar compiles it (it enforces no ``allOf`` of more
than one member, and drops what stands beside one). ``merge_all_of`` is the entry point; what
cannot be merged soundly, or what no JSON value satisfies, is a ValueError (a 400). This file is
the walk (over nested schemas, ``$ref``s and ``anyOf`` / ``oneOf`` branches); how one keyword's two
values combine is ``engine/json_schema_merge_rules.py``."""

from __future__ import annotations

from typing import Any

from engine.json_schema_merge_rules import (
    _ARRAY_KEYS,
    _CONSTRAINTS,
    _GROUPED,
    _OBJECT_KEYS,
    _TIGHTER,
    _additional,
    _annotated,
    _check_bounds,
    _lcm,
    _list,
    _merge_values,
    _number,
    _properties,
    _refusal,
    _rest_items,
    _strip,
    _trivial,
    _union,
    _Unsatisfiable,
)
from engine.json_schema_values import _resolve, _same

# Where a schema holds schemas: maps of them, lists of them, one of them.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("prefixItems", "items", "anyOf", "oneOf", "allOf")
_SCHEMA_ONE = (
    "additionalProperties unevaluatedProperties propertyNames items unevaluatedItems additionalItems "
    "contains not if then else contentSchema".split()
)
_MAX_MERGES, _MAX_MERGE_DEPTH = 20000, 120


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
