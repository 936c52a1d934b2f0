"""The jinja2 environment chat templates render in. A template is untrusted code (a model's, or a
client's own), so it runs in jinja2's immutable sandbox and sees only values rebuilt from plain
JSON types; the environment is transformers' (``trim_blocks``, ``lstrip_blocks``, its
extensions, ``raise_exception``, a non-HTML-escaping ``tojson``, ``strftime_now``), so every
template transformers takes parses and renders alike here. Choosing, caching and rendering
templates is ``engine/chat_template.py``. Torch-free.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.chat_messages import JsonArguments


class GenerationTag(jinja2.ext.Extension):
    """transformers' ``{% generation %}…{% endgeneration %}`` block, which marks the assistant's
    text for training masks (TRL, NeMo templates): rendered as its body, in a scope of its own."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


# The extensions transformers renders chat templates with (so every template it takes parses here).
_EXTENSIONS = [jinja2.ext.loopcontrols, GenerationTag]


class ChatTemplateError(ValueError):
    """The chat template is missing or failed on these messages (a client error: HTTP 400)."""


def _plain(value: Any) -> Any:
    """Rebuild what the template sees out of plain JSON types (templates are untrusted code)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, JsonArguments):
        return JsonArguments(_plain(dict(value)), str.__str__(value.text))
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _compile_template(source: str) -> jinja2.Template:
    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: Any = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        # Jinja's own tojson escapes HTML characters, which chat templates must not do.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=_EXTENSIONS)
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the model's chat template does not parse: {e}") from e
