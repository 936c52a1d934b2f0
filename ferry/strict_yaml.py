"""YAML reading for ferry's own files (`ferry up` cluster files, `ferry serve --config`).

PyYAML's ``safe_load`` keeps the last of two equal keys in a mapping without a word, so a file that
says ``router:`` twice runs with half of what its author wrote. The YAML spec calls such a mapping
invalid; here it is an error naming the key and both lines.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

MERGE_TAG = "tag:yaml.org,2002:merge"


class StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == MERGE_TAG:  # ``<<: *base`` then ``key: …`` overrides: that is allowed
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                line = first_line.get(key)
            except TypeError:  # an unhashable key: the base class says why it cannot be one
                continue
            if line is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first given on line {line + 1})", key_node.start_mark
                )
            first_line[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def not_yaml_problem(path: Path) -> str | None:
    """Why the file at ``path`` is not one to read as YAML, judged by its name (None: read it).
    A TOML file can parse as YAML into a string, whose error would then say nothing useful."""
    if path.suffix.lower() == ".toml":
        return "a TOML file: ferry reads YAML (JSON is YAML too)"
    return None


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` that refuses duplicate keys (``yaml.YAMLError`` naming the key)."""
    return yaml.load(text, Loader=StrictLoader)  # noqa: S506 - a SafeLoader subclass
