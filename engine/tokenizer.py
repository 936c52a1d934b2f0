"""A model's tokenizer and chat template, without torch and without transformers.

The router imports this module, so it must never import torch (or transformers, which pulls it
in). It loads ``tokenizer.json`` with the ``tokenizers`` library and reads ``tokenizer_config.json``
the way transformers 5's fast tokenizers do (named special tokens added as special; BOS/EOS
insertion from ``tokenizer.json``'s post-processor), so ``encode``/``decode`` give the same ids and text as
``PreTrainedTokenizerFast``. ``AutoTokenizer`` is deliberately avoided: transformers 5 swaps the
pre-tokenizer by ``model_type``, which would make the router and the engine disagree with the
checkpoint's own ``tokenizer.json``.

Chat templates are rendered with jinja2's immutable sandbox set up as transformers does
(``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, ``raise_exception``, a non-HTML-escaping
``tojson``, ``strftime_now``). Every failure a client can cause (no template, a template that
raises, content the template cannot take) is a ``ChatTemplateError`` (a ``ValueError``), which the
server maps to HTTP 400.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as _RustTokenizer

_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
_EXTRA_SPECIAL = ("additional_special_tokens", "extra_special_tokens")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_BYTE_FALLBACK_RE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class ChatTemplateError(ValueError):
    """The chat template is missing or failed on these messages (a client error: HTTP 400)."""


def _token_content(value: Any) -> str | None:
    """A special token in tokenizer_config.json is a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by ByteLevel BPE vocabularies."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    )
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


_BYTE_LEVEL_DECODE = {c: b for b, c in _bytes_to_unicode().items()}


def flatten_content_parts(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages with ``content`` given as a list of text parts, turned into plain strings.

    For templates that expect ``message['content']`` to be a string (most do). Text parts are joined
    with newlines, as vLLM does. Parts that are not text cannot be shown to a text-only model.
    """
    flat = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            message = {**message, "content": "\n".join(_part_text(p) for p in content)}
        flat.append(dict(message))
    return flat


def _part_text(part: Any) -> str:
    if isinstance(part, str):
        return part
    if isinstance(part, Mapping):
        kind = part.get("type", "text")
        if kind in ("text", "input_text") and isinstance(part.get("text"), str):
            return part["text"]
        raise ChatTemplateError(
            f"content part of type {kind!r} is not supported: this model accepts text only"
        )
    raise ChatTemplateError(
        f"a content part must be an object with 'type' and 'text', got {type(part).__name__}"
    )


def _check_parts(messages: Sequence[Mapping[str, Any]]) -> None:
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            for part in content:
                _part_text(part)


def template_iterates_content(template: str) -> bool:
    """Whether the template loops over ``message['content']`` itself (OpenAI-style parts).

    Like vLLM's content-format detection: such templates get the parts as given; the others get
    the text parts flattened to one string.
    """
    try:
        ast = jinja2.Environment(extensions=[jinja2.ext.loopcontrols]).parse(template)
    except jinja2.TemplateSyntaxError:
        return False
    for loop in ast.find_all(jinja2.nodes.For):
        it = loop.iter
        if isinstance(it, jinja2.nodes.Filter):  # e.g. message['content'] | selectattr(...)
            it = it.node
        if isinstance(it, jinja2.nodes.Getattr) and it.attr == "content":
            return True
        if (
            isinstance(it, jinja2.nodes.Getitem)
            and isinstance(it.arg, jinja2.nodes.Const)
            and it.arg.value == "content"
        ):
            return True
    return False


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
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _normalize_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """As transformers does: plain dicts, ``None`` values dropped, reasoning under all its names."""
    out = []
    for message in _plain(list(messages)):
        if not isinstance(message, dict):
            raise ChatTemplateError(f"each message must be an object, got {message!r}")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


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

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the model's chat template does not parse: {e}") from e


class Tokenizer:
    """Text <-> token ids for one model directory, plus its chat template."""

    def __init__(
        self,
        backend: _RustTokenizer,
        config: dict,
        chat_templates: dict[str, str],
        extra_eos_ids: Sequence[int] = (),
    ) -> None:
        self._tok = backend
        self._config = config
        self._chat_templates = chat_templates
        self._compiled: dict[str, tuple[jinja2.Template, bool]] = {}
        self._special_strings: dict[str, str] = {}
        self._setup_special_tokens()
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token_id: int | None = self._id_of(self._special_strings.get("bos_token"))
        eos = [self._id_of(self._special_strings.get("eos_token"))] + list(extra_eos_ids)
        self.eos_token_ids: list[int] = list(dict.fromkeys(i for i in eos if i is not None))
        self.all_special_ids: set[int] = {
            i for i, t in self._tok.get_added_tokens_decoder().items() if t.special
        }
        self._token_text_cache: dict[int, str] = {}

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json (a fast tokenizer file is required)")
        backend = _RustTokenizer.from_file(str(path))
        config = _read_json(model_dir / "tokenizer_config.json")
        extra_eos: list[int] = []
        for name in ("generation_config.json", "config.json"):
            extra_eos += _as_id_list(_read_json(model_dir / name).get("eos_token_id"))
        return cls(backend, config, _load_chat_templates(model_dir, config), extra_eos)

    # -- setup -------------------------------------------------------------------------------------

    def _setup_special_tokens(self) -> None:
        """Register the config's special tokens and BOS/EOS insertion as transformers 5 does."""
        cfg = self._config
        known = {str(t.content) for t in self._tok.get_added_tokens_decoder().values()}
        to_add: list[AddedToken] = []
        for _, spec in sorted(cfg.get("added_tokens_decoder", {}).items(), key=lambda kv: int(kv[0])):
            content = _token_content(spec)
            if content is not None and content not in known:
                to_add.append(
                    AddedToken(
                        content,
                        special=bool(spec.get("special", False)),
                        lstrip=bool(spec.get("lstrip", False)),
                        rstrip=bool(spec.get("rstrip", False)),
                        normalized=bool(spec.get("normalized", False)),
                        single_word=bool(spec.get("single_word", False)),
                    )
                )
                known.add(content)
        for name in _NAMED_SPECIAL:
            content = _token_content(cfg.get(name))
            if content is not None:
                self._special_strings[name] = content
        extras = []
        for name in _EXTRA_SPECIAL:
            value = cfg.get(name)
            values = value.values() if isinstance(value, Mapping) else (value or [])
            extras += [c for c in (_token_content(v) for v in values) if c is not None]
        for content in list(self._special_strings.values()) + extras:
            if content not in known:
                to_add.append(AddedToken(content, special=True, normalized=False))
                known.add(content)
        if to_add:
            self._tok.add_tokens(to_add)
        # Named special tokens that the vocab already holds as plain tokens still count as special.
        special_contents = list(self._special_strings.values()) + extras
        decoder = self._tok.get_added_tokens_decoder()
        unmarked = [
            c
            for c in special_contents
            if not any(str(t.content) == c and t.special for t in decoder.values())
        ]
        if unmarked:
            self._tok.add_special_tokens([AddedToken(c, special=True, normalized=False) for c in unmarked])

        # As transformers 5: tokenizer.json's post-processor decides BOS/EOS insertion and the
        # config's add_bos_token/add_eos_token only matter when the file has no post-processor.
        if self._tok.post_processor is None:
            self._set_post_processor(
                bool(cfg.get("add_bos_token", False)), bool(cfg.get("add_eos_token", False))
            )

    def _set_post_processor(self, add_bos: bool, add_eos: bool) -> None:
        bos, eos = self._special_strings.get("bos_token"), self._special_strings.get("eos_token")
        add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
        single = f"{(bos + ':0 ') if add_bos else ''}$A:0{(' ' + eos + ':0') if add_eos else ''}"
        pair = f"{single}{(' ' + bos + ':1') if add_bos else ''} $B:1{(' ' + eos + ':1') if add_eos else ''}"
        special = []
        if add_bos:
            special.append((bos, self._tok.token_to_id(bos)))
        if add_eos:
            special.append((eos, self._tok.token_to_id(eos)))
        self._tok.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=special
        )

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    # -- text <-> ids -----------------------------------------------------------------------------

    @property
    def backend(self) -> _RustTokenizer:
        """The underlying ``tokenizers.Tokenizer`` (for the detokenizer's windowed decoding)."""
        return self._tok

    @property
    def special_tokens(self) -> dict[str, str]:
        """Named special tokens (``bos_token``, ``eos_token``, ...) as strings, for chat templates."""
        return dict(self._special_strings)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``. Like transformers 5 on BPE tokenizers, no tokenization-space clean-up."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [self._tok.id_to_token(int(i)) for i in ids]

    def token_bytes(self, token_id: int) -> bytes | None:
        """The raw bytes a single token stands for, where the vocabulary says (ByteLevel or <0xNN>)."""
        token = self._tok.id_to_token(int(token_id))
        if token is None:
            return None
        m = _BYTE_FALLBACK_RE.match(token)
        if m:
            return bytes([int(m.group(1), 16)])
        if token_id in self._added_ids:
            return token.encode("utf-8")
        if self._byte_level and all(c in _BYTE_LEVEL_DECODE for c in token):
            return bytes(_BYTE_LEVEL_DECODE[c] for c in token)
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def token_text(self, token_id: int) -> str:
        """The text of one token, for logprobs.

        A token whose bytes are not valid UTF-8 on their own (a piece of a multi-byte character)
        is written as ``"bytes:\\xe2\\x80"``, as OpenAI and vLLM do, instead of a lossy U+FFFD.
        Special tokens are shown as their text.
        """
        cached = self._token_text_cache.get(token_id)
        if cached is not None:
            return cached
        text = self.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            raw = self.token_bytes(token_id)
            if raw is not None:
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError:
                    text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        self._token_text_cache[token_id] = text
        return text

    @cached_property
    def _added_ids(self) -> set[int]:
        return set(self._tok.get_added_tokens_decoder())

    @cached_property
    def _byte_level(self) -> bool:
        return "ByteLevel" in json.dumps(json.loads(self._tok.to_str()).get("decoder"))

    # -- chat template ----------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return bool(self._chat_templates)

    @property
    def chat_template_names(self) -> list[str]:
        return sorted(self._chat_templates)

    def get_chat_template(self, name: str | None = None, tools: list | None = None) -> str:
        """The template source: by name, else ``tool_use`` when tools are given and it exists, else ``default``."""
        if not self._chat_templates:
            raise ChatTemplateError(
                "this model has no chat template; use /v1/completions with a plain prompt instead"
            )
        if name is None:
            name = "tool_use" if tools and "tool_use" in self._chat_templates else "default"
        if name not in self._chat_templates:
            raise ChatTemplateError(
                f"no chat template named {name!r}; available: {', '.join(sorted(self._chat_templates))}"
            )
        return self._chat_templates[name]

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list | None = None,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` to the prompt text.

        Extra keyword arguments reach the template (e.g. ``enable_thinking``, ``documents``), as
        ``chat_template_kwargs`` do in vLLM; ``chat_template`` picks a named template.
        """
        source = self.get_chat_template(kwargs.pop("chat_template", None), tools)
        template, takes_parts = self._compiled_template(source)
        if not isinstance(messages, (list, tuple)):
            raise ChatTemplateError("messages must be a list of message objects")
        messages = _normalize_messages(messages)
        if takes_parts:
            _check_parts(messages)
        else:
            messages = flatten_content_parts(messages)
        context = {**self._special_strings, **_plain(kwargs)}
        try:
            return template.render(
                messages=messages, tools=_plain(tools), add_generation_prompt=add_generation_prompt, **context
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template error: {e}") from e
        except RecursionError as e:
            raise ChatTemplateError("chat template error: recursion too deep") from e
        except Exception as e:  # a template is code from the checkpoint: any crash is a bad request
            raise ChatTemplateError(f"chat template failed on these messages: {type(e).__name__}: {e}") from e

    def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """Render then encode; the template already holds every special token, so none are added."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)

    def _compiled_template(self, source: str) -> tuple[jinja2.Template, bool]:
        entry = self._compiled.get(source)
        if entry is None:
            entry = (_compile_template(source), template_iterates_content(source))
            self._compiled[source] = entry
        return entry


def _load_chat_templates(model_dir: Path, config: dict) -> dict[str, str]:
    """Named chat templates; files (``chat_template.jinja``, ``additional_chat_templates/``) win
    over ``tokenizer_config.json``, as in transformers."""
    templates: dict[str, str] = {}
    raw = config.get("chat_template")
    if isinstance(raw, str):
        templates["default"] = raw
    elif isinstance(raw, list):
        for entry in raw:
            if isinstance(entry, Mapping) and isinstance(entry.get("name"), str):
                templates[entry["name"]] = str(entry.get("template", ""))
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
