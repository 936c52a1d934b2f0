"""Where the JSON schemas sit inside a structural tag, in both of its formats (the ``json_schema``
items of the current one, the ``schema`` of the older structures + triggers): found, or each
replaced by a function of it. Structured outputs check, merge and rewrite a tag's schemas one by
one with the same code as a json constraint's (``engine/structured_output.py``,
``engine/grammar_rewrites.py``); this is only the walk to them. Pure functions of decoded JSON.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any


def map_tag_schemas(tag: Any, fn: Callable[[Any], Any]) -> Any:
    """A copy of structural tag ``tag`` (either format) with each JSON schema in it replaced by
    ``fn`` of the decoded schema; a schema given as JSON text stays text."""
    if isinstance(tag, list):
        return [map_tag_schemas(item, fn) for item in tag]
    if not isinstance(tag, dict):
        return tag
    schema_keys = (
        ("json_schema", tag.get("type") in ("json_schema", "qwen_xml_parameter")),
        ("schema", "begin" in tag),  # the older structures + triggers
    )
    for key, holds_schema in schema_keys:
        if holds_schema and key in tag:
            if not isinstance(tag[key], str):
                return {**tag, key: fn(tag[key])}
            try:
                decoded = json.loads(tag[key])
            except ValueError:  # not JSON: the compile says so
                return tag
            return {**tag, key: json.dumps(fn(decoded))}
    return {k: map_tag_schemas(v, fn) for k, v in tag.items()}


def tag_schemas(tag: Any) -> list[Any]:
    """The JSON schemas inside a structural tag, in either of its formats."""
    found, stack = [], [tag]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            if item.get("type") in ("json_schema", "qwen_xml_parameter") and "json_schema" in item:
                found.append(item["json_schema"])
            elif "begin" in item and "schema" in item:  # the older structures + triggers
                found.append(item["schema"])
            else:
                stack.extend(item.values())
    return found
