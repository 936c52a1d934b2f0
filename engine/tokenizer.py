"""A model's tokenizer and chat template, without torch and without transformers.

The router imports this module, so it must never import torch (or transformers, which pulls it
in). It loads ``tokenizer.json`` with the ``tokenizers`` library and reads ``tokenizer_config.json``
the way transformers 5's fast tokenizers do (named special tokens added as special; BOS/EOS
insertion from ``tokenizer.json``'s post-processor), so ``encode``/``decode`` give the same ids and text as
``PreTrainedTokenizerFast``. ``AutoTokenizer`` is deliberately avoided: transformers 5 swaps the
pre-tokenizer by ``model_type``, which would make the router and the engine disagree with the
checkpoint's own ``tokenizer.json``.

Chat templates live in ``engine.chat_template`` (``ChatTemplateError`` is re-exported here); a
``Tokenizer`` renders them with its own special tokens.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as _RustTokenizer

from engine.chat_template import (
    ChatTemplateError,
    ChatTemplates,
    flatten_content_parts,
    load_chat_templates,
    template_iterates_content,
)

__all__ = ["ChatTemplateError", "Tokenizer", "flatten_content_parts", "template_iterates_content"]

_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
_EXTRA_SPECIAL = ("additional_special_tokens", "extra_special_tokens")
_BYTE_FALLBACK_RE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
# Texts longer than this are encoded through ``encode_batch``: `tokenizers` lets go of the GIL
# only there (``encode`` holds it throughout: about 2 s for a 3 MB prompt), so the engine loop,
# and an event loop that tokenizes on a worker thread, run on while a long prompt is encoded.
GIL_FREE_CHARS = 2048


def encoding(backend: _RustTokenizer, text: str, add_special_tokens: bool) -> Any:
    """``backend.encode(text, add_special_tokens)``, without holding the GIL for a long text."""
    if len(text) > GIL_FREE_CHARS:
        return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
    return backend.encode(text, add_special_tokens=add_special_tokens)


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


def _as_ids(ids: Sequence[int]) -> list[int]:
    ids = [int(i) for i in ids]
    if ids and (min(ids) < 0 or max(ids) >= 1 << 32):
        bad = next(i for i in ids if not 0 <= i < 1 << 32)
        raise ValueError(f"token id {bad} is out of range")
    return ids


class Tokenizer:
    """Text <-> token ids for one model directory, plus its chat template."""

    def __init__(
        self,
        backend: _RustTokenizer,
        config: dict,
        chat_templates: Mapping[str, str],
        extra_eos_ids: Sequence[int] = (),
        chat_template_content_format: str = "auto",
        image_token: str | None = None,
    ) -> None:
        self._tok = backend
        self._config = config
        self._special_strings: dict[str, str] = {}
        self._setup_special_tokens()
        # A vision-language model's image placeholder (``<image>``): chat templates render image parts.
        self.image_token = image_token
        self._chat_templates = ChatTemplates(
            chat_templates, self._special_strings, chat_template_content_format, image_token
        )
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        # transformers' names too (vLLM scripts write ``stop_token_ids=[tokenizer.eos_token_id]``).
        self.bos_token_id: int | None = self._id_of(self._special_strings.get("bos_token"))
        self.eos_token_id: int | None = self._id_of(self._special_strings.get("eos_token"))
        self.pad_token_id: int | None = self._id_of(self._special_strings.get("pad_token"))
        eos = [self.eos_token_id] + list(extra_eos_ids)
        self.eos_token_ids: list[int] = list(dict.fromkeys(i for i in eos if i is not None))
        self.all_special_ids: set[int] = {
            i for i, t in self._tok.get_added_tokens_decoder().items() if t.special
        }
        self._token_text_cache: dict[int, str] = {}
        self._text_width_cache: dict[int, int] = {}

    @classmethod
    def from_dir(
        cls,
        model_dir: str | Path,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        config_dir: str | Path | None = None,
    ) -> Tokenizer:
        """``chat_template``: a template's text that replaces the model's own (all of them: vLLM's
        ``--chat-template``); ``chat_template_content_format``: see ``ChatTemplates``; ``config_dir``:
        the model directory whose ``generation_config.json`` / ``config.json`` eos ids count too, when
        the tokenizer is another directory's (vLLM's ``--tokenizer``; default: ``model_dir``)."""
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(  # both commands read it, and only `ferry serve` has --tokenizer
                f"{model_dir} has no tokenizer.json (a fast tokenizer file is required: `ferry serve "
                "--tokenizer DIR` reads it from another directory; `ferry router --model DIR` takes the "
                "directory that holds it)"
            )
        backend = _RustTokenizer.from_file(str(path))
        config = _read_json(model_dir / "tokenizer_config.json")
        extra_eos: list[int] = []
        config_dir = Path(config_dir) if config_dir is not None else model_dir
        for name in ("generation_config.json", "config.json"):
            extra_eos += _as_id_list(_read_json(config_dir / name).get("eos_token_id"))
        templates = {"default": chat_template} if chat_template else load_chat_templates(model_dir, config)
        model_config = _read_json(config_dir / "config.json")
        image_token = None
        if "vision_config" in model_config:  # a vision-language model (LLaVA): its image token's text
            image_id = model_config.get("image_token_id", model_config.get("image_token_index"))
            image_token = backend.id_to_token(image_id) if isinstance(image_id, int) else None
        return cls(backend, config, templates, extra_eos, chat_template_content_format, image_token)

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
        return encoding(self._tok, text, add_special_tokens).ids

    def encode_offsets(
        self, text: str, add_special_tokens: bool = True
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """``encode``'s ids with each token's (start, end) character offsets in ``text``."""
        enc = encoding(self._tok, text, add_special_tokens)
        return enc.ids, [tuple(o) for o in enc.offsets]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``. Like transformers 5 on BPE tokenizers, no tokenization-space clean-up.

        Ids past the tokenizer's vocabulary (a model's padded embedding rows) have no text, as in
        transformers; a negative id is a ValueError.
        """
        return self._tok.decode(_as_ids(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """Vocabulary strings of ``ids`` ("" for an id past the vocabulary)."""
        return [self._tok.id_to_token(i) or "" for i in _as_ids(ids)]

    def check_ids(self, ids: Sequence[int]) -> list[int]:
        """``ids`` as a list of ints, or ValueError naming the first id outside ``[0, vocab_size)``."""
        ids = _as_ids(ids)
        if ids and max(ids) >= self.vocab_size:
            bad = next(i for i in ids if i >= self.vocab_size)
            raise ValueError(f"token id {bad} is out of range: the vocabulary has {self.vocab_size} tokens")
        return ids

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
        return self._text_in_context(token_id).encode("utf-8")

    def token_text(self, token_id: int) -> str:
        """The text of one token, for logprobs.

        A token whose bytes are not valid UTF-8 on their own (a piece of a multi-byte character)
        is written as ``"bytes:\\xe2\\x80"``, as OpenAI and vLLM do, instead of a lossy U+FFFD.
        Special tokens are shown as their text.
        """
        cached = self._token_text_cache.get(token_id)
        if cached is not None:
            return cached
        text = self._text_in_context(token_id)
        if "\ufffd" in text:
            raw = self.token_bytes(token_id)
            if raw is not None:
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError:
                    text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        self._token_text_cache[token_id] = text
        return text

    def text_width(self, token_id: int, skip_special_tokens: bool = True) -> int:
        """How many characters the token adds to decoded text, for legacy ``text_offset``: a
        special token none when skipped, a piece of a multi-byte character one (its U+FFFD), else
        the length of its text as it reads after other text."""
        if skip_special_tokens and token_id in self.all_special_ids:
            return 0
        width = self._text_width_cache.get(token_id)
        if width is None:
            width = self._text_width_cache[token_id] = len(self._text_in_context(token_id))
        return width

    def _text_in_context(self, token_id: int) -> str:
        """The token's text as it reads after other text: decoders that strip a leading space
        (SentencePiece's "▁Hello" -> "Hello" at the start) would otherwise lose it."""
        anchor = self._anchor
        if anchor is None or token_id in self._added_ids:
            return self._tok.decode([token_id], skip_special_tokens=False)
        anchor_id, anchor_text = anchor
        both = self._tok.decode([anchor_id, token_id], skip_special_tokens=False)
        if both.startswith(anchor_text):
            return both[len(anchor_text) :]
        return self._tok.decode([token_id], skip_special_tokens=False)

    @cached_property
    def _anchor(self) -> tuple[int, str] | None:
        """A plain token that decodes to one letter, to put in front of a token being shown alone."""
        for letter in "aeiostnrxyz":
            token_id = self._tok.token_to_id(letter)
            if token_id is not None and token_id not in self._added_ids:
                if self._tok.decode([token_id], skip_special_tokens=False) == letter:
                    return token_id, letter
        return None

    @cached_property
    def _added_ids(self) -> set[int]:
        return set(self._tok.get_added_tokens_decoder())

    @cached_property
    def _byte_level(self) -> bool:
        decoder = self._tok.decoder
        return decoder is not None and b'"ByteLevel"' in decoder.__getstate__()

    # -- chat template ----------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return bool(self._chat_templates)

    @property
    def chat_template_names(self) -> list[str]:
        return self._chat_templates.names

    def get_chat_template(self, name: str | None = None, tools: list | None = None) -> str:
        return self._chat_templates.get(name, tools)

    def info(self) -> dict[str, Any]:
        """vLLM's ``GET /tokenizer_info``: the tokenizer's configuration as tokenizer_config.json
        holds it, with ``tokenizer_class`` always set and ``chat_template`` the default template
        served (``--chat-template``'s when given)."""
        info = dict(self._config)
        info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        if self.has_chat_template:
            info["chat_template"] = self.get_chat_template()
        return info

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list | None = None,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` to the prompt text (see ``ChatTemplates.render``).

        Extra keyword arguments reach the template (e.g. ``enable_thinking``, ``documents``), as
        ``chat_template_kwargs`` do in vLLM; ``chat_template`` picks a named template and
        ``continue_final_message`` leaves the last message open.
        """
        return self._chat_templates.render(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs
        )

    def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """Render then encode; the template already holds every special token, so none are added."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)
