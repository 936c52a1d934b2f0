"""Chat templates: loading them from a model directory and rendering them safely. Torch-free.

Rendering follows transformers: jinja2's immutable sandbox with ``trim_blocks``,
``lstrip_blocks`` and ``loopcontrols``; ``raise_exception``, a non-HTML-escaping ``tojson`` and
``strftime_now``; messages rebuilt from plain JSON types with ``None`` values dropped; the named
special tokens (``bos_token``, ``eos_token``, ...) visible as variables. Message content given as a
list of text parts reaches templates that loop over parts as is, and is flattened to one string
for templates that expect a string (as vLLM does).

Every failure a client can cause (no template, a template that raises, content the template
cannot take) is a ``ChatTemplateError`` (a ``ValueError``), which the server maps to HTTP 400.
The sandboxed jinja2 environment itself (and ``ChatTemplateError``) is ``engine/chat_sandbox.py``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes

from engine.chat_messages import IMAGE_PART_TYPES as IMAGE_PART_TYPES
from engine.chat_messages import template_message as template_message
from engine.chat_sandbox import _EXTENSIONS, ChatTemplateError, _compile_template, _plain

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Marks the end of the final message when it is to be continued; cut off after rendering. Its
# trailing space tells whether the template trims the message (``| trim``): then the prompt ends
# with the message's text stripped, as transformers (and so vLLM) end it.
_CONTINUE_TAG = "\x00FERRY_CONTINUE_FINAL_MESSAGE\x00 "


def flatten_content_parts(
    messages: Sequence[Mapping[str, Any]], image_token: str | None = None
) -> list[dict[str, Any]]:
    """Messages with ``content`` given as a list of text parts, turned into plain strings.

    For templates that expect ``message['content']`` to be a string (most do). Text parts are joined
    with newlines, as vLLM does; an image part (``{"type": "image"}``) becomes ``image_token`` where
    it stands, for a vision-language model. Other parts cannot be shown to a text-only model.
    """
    flat = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            message = {**message, "content": "\n".join(_part_text(p, image_token) for p in content)}
        flat.append(dict(message))
    return flat


def _part_text(part: Any, image_token: str | None = None) -> str:
    if isinstance(part, str):
        return part
    if isinstance(part, Mapping):
        kind = part.get("type", "text")
        if kind in ("text", "input_text") and isinstance(part.get("text"), str):
            return part["text"]
        if kind == "image" and image_token is not None:
            return image_token
        raise ChatTemplateError(
            f"content part of type {kind!r} is not supported: this model accepts text only"
            if image_token is None or kind not in IMAGE_PART_TYPES
            else f"content part of type {kind!r} is not supported"
        )
    raise ChatTemplateError(
        f"a content part must be an object with 'type' and 'text', got {type(part).__name__}"
    )


def _as_parts(message: dict[str, Any]) -> dict[str, Any]:
    """A message whose string content becomes one text part (the ``openai`` content format)."""
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": [{"type": "text", "text": content}]}
    return message


def _check_parts(messages: Sequence[Mapping[str, Any]], image_token: str | None) -> None:
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            for part in content:
                _part_text(part, image_token)


def template_iterates_content(template: str) -> bool:
    """Whether the template loops over ``message['content']`` itself (OpenAI-style parts).

    Like vLLM's content-format detection: such templates get the parts as given; the others get
    the text parts flattened to one string. Follows ``{% set c = message['content'] %}`` aliases.
    """
    try:
        ast = jinja2.Environment(extensions=_EXTENSIONS).parse(template)
    except jinja2.TemplateSyntaxError:
        return False
    aliases = {
        node.target.name
        for node in ast.find_all(jinja2.nodes.Assign)
        if isinstance(node.target, jinja2.nodes.Name) and _is_content(node.node)
    }
    for loop in ast.find_all(jinja2.nodes.For):
        it = loop.iter
        while isinstance(it, jinja2.nodes.Filter):  # e.g. message['content'] | selectattr(...)
            it = it.node
        if _is_content(it) or (isinstance(it, jinja2.nodes.Name) and it.name in aliases):
            return True
    return False


def _is_content(node: jinja2.nodes.Node) -> bool:
    if isinstance(node, jinja2.nodes.Filter):
        return _is_content(node.node)
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    return (
        isinstance(node, jinja2.nodes.Getitem)
        and isinstance(node.arg, jinja2.nodes.Const)
        and node.arg.value == "content"
    )


def _normalize_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """As transformers does: plain dicts, ``None`` values dropped, reasoning under all its names."""
    out = []
    for message in _plain(list(messages)):
        if not isinstance(message, dict):
            raise ChatTemplateError(f"each message must be an object, got {message!r}")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            # Every name, whichever the client sent (vLLM's ``reasoning`` or older ``reasoning_content``):
            # templates read one or the other (Qwen3's reasoning_content, newer ones reasoning).
            message = {
                "thinking": reasoning,
                **message,
                "reasoning_content": reasoning,
                "reasoning": reasoning,
            }
        out.append(message)
    return out


CONTENT_FORMATS = ("auto", "string", "openai")
MAX_COMPILED = 32  # compiled templates kept: the model's few, and the latest requests' own


def resolve_chat_template(value: str) -> str:
    """A ``--chat-template`` value as the template's text: a file's contents, or the value itself
    when it is a template written inline (it holds ``{``, ``}`` or a newline; backslash escapes
    such as ``\\n`` are read as such, as vLLM does). ValueError for a path that does not exist
    or a template that does not parse."""
    path = Path(value).expanduser()
    if path.is_file():
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"chat template {value}: cannot read it: {e}") from e
    elif any(c in value for c in "{}\n"):
        # Escapes become characters; any other character stays itself (latin-1 with backslashes
        # for the rest is what unicode_escape reads back unchanged).
        source = value.encode("latin-1", "backslashreplace").decode("unicode_escape")
    else:
        raise ValueError(f"chat template {value!r} looks like a file path, but no such file exists")
    try:
        _compile_template(source)
    except ChatTemplateError as e:
        raise ValueError(f"chat template {value if path.is_file() else '(inline)'}: {e}") from e
    return source


class ChatTemplates:
    """A model's named chat templates (``default``, maybe ``tool_use`` ...), compiled on first use.

    ``content_format`` (vLLM's ``--chat-template-content-format``): how message content reaches
    the template; ``auto`` looks at whether the template loops over content parts, ``string``
    joins text parts into one string, ``openai`` gives every content as a list of text parts.
    """

    def __init__(
        self,
        templates: Mapping[str, str],
        special_tokens: Mapping[str, str],
        content_format: str = "auto",
        image_token: str | None = None,
    ) -> None:
        """``image_token``: a vision-language model's image placeholder text; image parts
        (``{"type": "image"}``) reach templates that loop over parts as they are and become this
        text in string content. None: image parts are refused (a text-only model)."""
        if content_format not in CONTENT_FORMATS:
            raise ValueError(f"chat template content format must be one of {', '.join(CONTENT_FORMATS)}")
        self._templates = {name: t for name, t in templates.items() if t}
        self._special = dict(special_tokens)
        self._content_format = content_format
        self.image_token = image_token
        self._compiled: dict[str, tuple[jinja2.Template, bool]] = {}
        # The event loop and worker threads render at once (the server plans long prompts off its
        # loop): the cache's check, eviction and insert take turns; compiling does not.
        self._compiled_lock = threading.Lock()

    @classmethod
    def from_dir(
        cls, model_dir: str | Path, config: Mapping[str, Any], special_tokens: Mapping[str, str]
    ) -> ChatTemplates:
        return cls(load_chat_templates(Path(model_dir), config), special_tokens)

    def __bool__(self) -> bool:
        return bool(self._templates)

    @property
    def names(self) -> list[str]:
        return sorted(self._templates)

    def get(self, name: str | None = None, tools: list | None = None) -> str:
        """The template source: by name, else ``tool_use`` when tools are given (an empty list too,
        as transformers picks) and it exists, else ``default``. As in transformers, ``name`` may also
        be a template's text (one holding ``{{`` or ``{%``): that is the template then."""
        if name is not None and not isinstance(name, str):
            raise ChatTemplateError(f"chat_template must be a string, got {type(name).__name__}")
        if name is not None and name not in self._templates and ("{{" in name or "{%" in name):
            return name
        if not self._templates:
            raise ChatTemplateError(
                "this model has no chat template; use /v1/completions with a plain prompt instead"
            )
        if name is None:
            name = "tool_use" if tools is not None and "tool_use" in self._templates else "default"
        if name not in self._templates:
            raise ChatTemplateError(f"no chat template named {name!r}; available: {', '.join(self.names)}")
        return self._templates[name]

    def render(
        self,
        messages: Sequence[Any],
        add_generation_prompt: bool = True,
        tools: list | None = None,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """Render ``messages``; ``kwargs`` reach the template (``enable_thinking``, ``documents`` ...).

        ``continue_final_message``: the prompt ends inside the last message (e.g. a partial
        assistant answer to be continued), as in transformers and vLLM.
        """
        template, takes_parts = self._compile(self.get(chat_template, tools))
        if not isinstance(messages, (list, tuple)):
            raise ChatTemplateError("messages must be a list of message objects")
        messages = _normalize_messages(messages)
        if self._content_format != "auto":
            takes_parts = self._content_format == "openai"
        if takes_parts:
            _check_parts(messages, self.image_token)
            if self._content_format == "openai":
                messages = [_as_parts(m) for m in messages]
        else:
            messages = flatten_content_parts(messages, self.image_token)
        if continue_final_message:
            if add_generation_prompt:
                raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be set")
            _tag_final_message(messages)
        context = {**self._special, **_plain(kwargs)}
        try:
            text = template.render(
                messages=messages, tools=_plain(tools), add_generation_prompt=add_generation_prompt, **context
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template error: {e}") from e
        except RecursionError as e:
            raise ChatTemplateError("chat template error: recursion too deep") from e
        except Exception as e:  # a template is code from the checkpoint: any crash is a bad request
            raise ChatTemplateError(f"chat template failed on these messages: {type(e).__name__}: {e}") from e
        if continue_final_message:
            at = text.rfind(_CONTINUE_TAG.rstrip())
            if at < 0:
                raise ChatTemplateError(
                    "continue_final_message: the template dropped the final message's content"
                )
            text = text[:at] if text.startswith(_CONTINUE_TAG, at) else text[:at].rstrip()
        return text

    def _compile(self, source: str) -> tuple[jinja2.Template, bool]:
        entry = self._compiled.get(source)
        if entry is not None:
            return entry
        entry = (_compile_template(source), template_iterates_content(source))
        with self._compiled_lock:
            if source not in self._compiled:
                if len(self._compiled) >= MAX_COMPILED:  # requests' own templates: keep the newest few
                    del self._compiled[next(iter(self._compiled))]
                self._compiled[source] = entry
        return entry


def _tag_final_message(messages: list[dict[str, Any]]) -> None:
    if not messages:
        raise ChatTemplateError("continue_final_message needs at least one message")
    last = messages[-1]
    content = last.get("content")
    if isinstance(content, str):
        last["content"] = content + _CONTINUE_TAG
        return
    if isinstance(content, list):
        for part in reversed(content):
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                part["text"] += _CONTINUE_TAG
                return
    raise ChatTemplateError("continue_final_message: the final message has no text to continue")


def load_chat_templates(model_dir: Path, config: dict) -> dict[str, str]:
    """Named chat templates; files (``chat_template.jinja``, ``additional_chat_templates/``) win
    over ``tokenizer_config.json``, as in transformers; a processor's ``chat_template.json`` serves
    when neither has a default."""
    templates: dict[str, str] = {}
    raw = config.get("chat_template")
    if isinstance(raw, str):
        templates["default"] = raw
    elif isinstance(raw, list):
        for entry in raw:
            if isinstance(entry, Mapping) and isinstance(entry.get("name"), str):
                templates[entry["name"]] = str(entry.get("template", ""))
    if "default" not in templates and (model_dir / "chat_template.json").is_file():
        # A multimodal model's processor template (Gemma 3, Qwen2-VL): {"chat_template": "..."}.
        try:
            processor = json.loads((model_dir / "chat_template.json").read_text(encoding="utf-8"))
        except ValueError:
            processor = {}
        if isinstance(processor, Mapping) and isinstance(processor.get("chat_template"), str):
            templates["default"] = processor["chat_template"]
    files: dict[str, str] = {}
    if (model_dir / "chat_template.jinja").is_file():
        files["default"] = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    extra_dir = model_dir / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            files[path.stem] = path.read_text(encoding="utf-8")
    if files:
        templates = files
    return {name: t for name, t in templates.items() if t}
