"""Turn a request body into the block hashes the cache_aware policy matches on.

Two keyers behind one interface, chosen once at start:

* ``TokenKeyer`` (``--model DIR``): tokenizes exactly as a replica does (chat template +
  ``encode``, ``engine.tokenizer``, torch-free) and hashes full blocks with ``kvcache.keys``,
  so its hashes are the replicas' own block hashes (they can be matched with block events).
* ``TextKeyer`` (no tokenizer): chained hashes over fixed-size chunks of the request's text.
  Only the router's own history can be matched then, but shared prefixes still land together.

Chats with images (a LLaVA-style ``--model``): each image token is expanded into the image's
placeholder run (its length read from the model's processor files) and keyed by the digest of the
image's bytes, as the replica keys it (``kvcache.keys.image_source_digest``), for images given as
data URLs. The router fetches no URL: an image given by an http(s) or file URL is keyed by its URL
instead (a digest in a namespace of its own), so the blocks from that image on match only what the
router itself sent (its own history, not the replicas' block events), which is what keeps a
multi-turn chat that resends the same URL on the replica holding its KV.

Completions given as token ids are hashed exactly by both, and so are the ``token_ids`` of vLLM's
``/inference/v1/generate`` (its prompt as the replica runs it: ``generate_as_completion``).
Completions with ``prompt_embeds`` (base64 tensors the router does not decode: it never loads
torch) are keyed by one hash of their first payload, apart from token and text hashes: identical
embeddings land on the replica that has their blocks, different ones share nothing. A body the
keyer cannot read yields no hashes (the replica reports the client's error; routing just loses its
cache hint).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from engine.chat_template import template_message
from engine.media import message_image_parts
from engine.multimodal import tokens_per_image_from_files
from kvcache.keys import DIGEST_SIZE, block_hashes, image_source_digest, salt_extra
from router.reuse_encoder import ReuseEncoder
from server.anthropic_protocol import MessagesRequest
from server.chat_defaults import ChatDefaults
from server.responses_input import chat_messages, chat_tools, continues_final_message

logger = logging.getLogger("ferry.router")

TEXT_CHUNK_CHARS = 64  # ~16 tokens of English: one text "block"
_TEXT_SPACE = b"router-text"  # keeps text-chunk hashes apart from real token-block hashes
_EMBEDS_SPACE = b"router-embeds"  # and prompt-embeddings payload hashes apart from both
_IMAGE_URL_SPACE = b"router-image-url\x00"  # URL-keyed images apart from content digests
TOKENS_GENERATE_PATH = "/inference/v1/generate"  # vLLM's tokens-in/tokens-out route


def _no_extra(model: object) -> bytes:
    return b""


class PromptKeyer(ABC):
    # The block-hash salt of a body's ``model`` (a LoRA adapter's: ``Replicas.lora_extra``).
    model_extra: Callable[[object], bytes] = staticmethod(_no_extra)

    def keys(self, path: str, body: dict[str, Any]) -> tuple[list[bytes], int]:
        """(block hashes of the prompt, number of prompt tokens, exact or estimated); ``([], 0)``
        for a body the keyer cannot read, whatever is wrong in it: the hashes are only a routing
        hint, and the replica answers the client's mistake with its own 400."""
        try:
            if path.endswith("/v1/responses"):
                path, body = "/v1/chat/completions", responses_as_chat(body)
            elif path.endswith("/v1/messages"):
                path, body = "/v1/chat/completions", messages_as_chat(body)
            elif path.endswith(TOKENS_GENERATE_PATH):
                path, body = "/v1/completions", generate_as_completion(body)
            elif body.get("prompt_embeds") is not None:
                return self._embeds_keys(body)
            return self._keys(path, body)
        except Exception:  # noqa: BLE001 - any malformed body; a router error would be a 500
            logger.debug("no prompt keys for a %s body", path, exc_info=True)
            return [], 0

    def body_extra(self, body: dict[str, Any]) -> bytes:
        """The salt of a body's block hashes, as its replica salts them: its adapter's
        (``model_extra``), then its ``cache_salt``'s."""
        salt = body.get("cache_salt")
        return self.model_extra(body.get("model")) + salt_extra(
            salt if isinstance(salt, str) and salt else None
        )

    def _embeds_keys(self, body: dict[str, Any]) -> tuple[list[bytes], int]:
        """One hash of the first prompt's embeddings payload (its base64 text), salted as the body
        is; the token count is left to the body-size estimate."""
        raw = body["prompt_embeds"]
        first = raw if isinstance(raw, str) else raw[0]
        if not isinstance(first, str) or not first:
            return [], 0
        h = hashlib.blake2b(_EMBEDS_SPACE + self.body_extra(body) + first.encode(), digest_size=16)
        return [h.digest()], 0

    @abstractmethod
    def _keys(self, path: str, body: dict[str, Any]) -> tuple[list[bytes], int]:
        """``keys`` without the guard."""


def responses_as_chat(body: dict[str, Any]) -> dict[str, Any]:
    """A Responses API body as the chat body its replica renders (``server/serving_responses.py``
    translates it with the same functions), for the prompt's keys."""
    tools, choice = chat_tools(body.get("tools"), body.get("tool_choice"))
    reasoning = body.get("reasoning")  # its effort reaches the template (``to_chat_request``)
    return {
        # What salts its block hashes on the replica: the adapter its model names, its cache_salt.
        "model": body.get("model"),
        "cache_salt": body.get("cache_salt"),
        "messages": chat_messages(body.get("instructions"), body["input"]),
        "tools": tools,
        "tool_choice": choice,
        "reasoning_effort": reasoning.get("effort") if isinstance(reasoning, dict) else None,
        "add_generation_prompt": not continues_final_message(body["input"]),
        "continue_final_message": continues_final_message(body["input"]),
        # vLLM's template variables, merged with the replica's defaults as a chat request's are
        "chat_template_kwargs": body.get("chat_template_kwargs"),
    }


def generate_as_completion(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``/inference/v1/generate`` body as the completion its replica runs
    (``server/token_generate.py`` ``completion_of``): its ``token_ids`` are the prompt, salted by its
    ``model`` (a LoRA adapter's) and ``cache_salt`` as a completion's blocks are. Anything but token
    ids (which the replica refuses) is no prompt: no hint."""
    ids = body.get("token_ids")
    prompt = ids if isinstance(ids, list) and all(type(t) is int for t in ids) else None
    return {"prompt": prompt, "model": body.get("model"), "cache_salt": body.get("cache_salt")}


def messages_as_chat(body: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic Messages API body as the chat body its replica renders (``MessagesRequest``'s
    own translation, ``server/serving_messages.py``), for the prompt's keys."""
    return MessagesRequest.model_validate(body).chat_body()


def _token_id_prompt(body: dict[str, Any]) -> list[int] | None:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return prompt
    return None


class TokenKeyer(PromptKeyer):
    def __init__(
        self,
        tokenizer: Any,
        block_size: int,
        chat: ChatDefaults = ChatDefaults(),
        image: tuple[int, int] | None = None,
    ) -> None:
        """``image``: a vision-language model's (image token id, placeholder tokens per image)."""
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.chat = chat  # the replicas' template defaults (server/chat_defaults.py)
        self.image = image
        # A conversation's next turn re-renders every earlier message: encode only what is new.
        self.chat_encoder = ReuseEncoder(tokenizer.backend)

    @classmethod
    def from_dir(
        cls,
        model_dir: str,
        block_size: int,
        chat_template: str | None = None,
        content_format: str = "auto",
        chat: ChatDefaults = ChatDefaults(),
    ) -> TokenKeyer:
        """``chat_template`` (the template's text), ``content_format`` and ``chat``: the replicas'
        ``--chat-template``, ``--chat-template-content-format``, ``--default-chat-template-kwargs`` and
        ``--exclude-tools-when-tool-choice-none``, to render chats as they do."""
        from engine.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_dir(model_dir, chat_template, content_format)
        image = None
        token_id = tokenizer.backend.token_to_id(tokenizer.image_token) if tokenizer.image_token else None
        run = tokens_per_image_from_files(model_dir) if token_id is not None else None
        if token_id is not None and run is not None:
            image = (token_id, run)
        return cls(tokenizer, block_size, chat, image)

    def token_ids(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """The replica's prompt token ids for ``body``; None when it has no prompt we read (raises
        on a malformed one: ``keys`` turns that into no hint)."""
        if path.endswith("/chat/completions"):
            # Exactly the replica's rendering (``server/prompts.py`` chat_prompt): the same
            # message normalisation, null meaning the default, the same merge of the variables.
            messages = [template_message(m) for m in body["messages"]]
            add_generation_prompt = body.get("add_generation_prompt")
            kwargs = self.chat.render_kwargs(
                body.get("chat_template_kwargs"),
                add_generation_prompt=True if add_generation_prompt is None else add_generation_prompt,
                continue_final_message=bool(body.get("continue_final_message")),
                documents=body.get("documents"),
                reasoning_effort=body.get("reasoning_effort"),
                tools=body.get("tools"),
                tool_choice=body.get("tool_choice"),
            )
            named = kwargs.get("chat_template")
            if body.get("chat_template") is not None or (
                named is not None and named not in self.tokenizer.chat_template_names
            ):
                # A template of the request's own: the router runs none (a template is code a
                # client would have it run; replicas run them only if trusted). No hint.
                return None
            text = self.tokenizer.apply_chat_template(messages, **kwargs)
            if body.get("add_special_tokens"):  # vLLM's: the tokenizer's BOS on top of the template's
                return self.tokenizer.encode(text, add_special_tokens=True)
            return self.chat_encoder.encode(text)  # = encode_chat: no special tokens added
        ids = _token_id_prompt(body)
        if ids is not None:
            return ids
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tokenizer.encode(
                prompt, add_special_tokens=body.get("add_special_tokens") is not False
            )
        return None

    def _keys(self, path: str, body: dict[str, Any]) -> tuple[list[bytes], int]:
        ids = self.token_ids(path, body)
        if ids is None:
            return [], 0
        keep = body.get("truncate_prompt_tokens")
        if type(keep) is int and 0 < keep < len(ids):
            # The replica keeps the prompt's last N tokens, or its first under truncation_side
            # "right" (``server.prompts.truncated``); -1 (the model's context length, which the
            # router does not know) cuts only prompts longer than that.
            ids = ids[:keep] if body.get("truncation_side") == "right" else ids[-keep:]
        if self.image is not None and path.endswith("/chat/completions") and self.image[0] in ids:
            return self._image_keys(ids, body)
        return block_hashes(ids, self.block_size, self.body_extra(body)), len(ids)

    def _image_keys(self, ids: list[int], body: dict[str, Any]) -> tuple[list[bytes], int]:
        """A chat prompt's keys with its images' placeholder runs, as the replica expands and keys
        them; the prompt's length counts every run."""
        token, run = self.image  # type: ignore[misc]
        positions = [i for i, t in enumerate(ids) if t == token]
        sources = message_image_parts(body["messages"])
        extra, length = self.body_extra(body), len(ids) + (run - 1) * len(positions)
        if len(sources) != len(positions):  # the replica answers 400: no hint past the first
            return block_hashes(ids[: positions[0]], self.block_size, extra), length
        expanded: list[int] = []
        spans: list[tuple[int, int, bytes]] = []
        last = 0
        for position, source in zip(positions, sources, strict=True):
            digest = _data_url_digest(source) or _url_digest(source)
            expanded += ids[last:position]
            if digest is None:  # neither: keys stop before it (the replica will answer 400)
                break
            spans.append((len(expanded), run, digest))
            expanded += [token] * run
            last = position + 1
        else:
            expanded += ids[last:]
        return block_hashes(expanded, self.block_size, extra, images=spans), length


def _data_url_digest(source: Any) -> bytes | None:
    """The digest of a data URL image's bytes, decoded as the replica decodes them
    (``engine/media.py``); None for any other source."""
    if not isinstance(source, str) or not source.startswith("data:"):
        return None
    header, sep, payload = source[5:].partition(",")
    if not sep or not header.endswith(";base64"):
        return None
    try:
        return image_source_digest(base64.b64decode(payload, validate=True))
    except (binascii.Error, ValueError):
        return None


def _url_digest(source: Any) -> bytes | None:
    """An http(s) or file URL image's key: a digest of the URL (not of bytes the router never
    fetches), apart from every content digest; None for any other source."""
    if not isinstance(source, str) or not source.startswith(("http://", "https://", "file://")):
        return None
    return hashlib.blake2b(_IMAGE_URL_SPACE + source.encode(), digest_size=DIGEST_SIZE).digest()


class TextKeyer(PromptKeyer):
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def _keys(self, path: str, body: dict[str, Any]) -> tuple[list[bytes], int]:
        extra = self.body_extra(body)
        ids = _token_id_prompt(body)
        if ids is not None:
            return block_hashes(ids, self.block_size, extra), len(ids)
        text = _request_text(path, body)
        if not text:
            return [], 0
        codes = [ord(c) for c in text]
        return block_hashes(codes, TEXT_CHUNK_CHARS, extra=_TEXT_SPACE + extra), max(1, len(text) // 4)


def _request_text(path: str, body: dict[str, Any]) -> str:
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list):
            return ""
        out = []
        for m in messages:
            if not isinstance(m, dict):
                return "".join(out)
            content = m.get("content")
            if isinstance(content, list):
                content = "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
            out.append(f"<{m.get('role', '')}>{content if isinstance(content, str) else ''}\x00")
        return "".join(out)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else ""


# Bodies larger than this are keyed on a worker thread: rendering and tokenizing a long chat prompt
# takes milliseconds (about 2.5 ms for 3.5k tokens here), during which the event loop relaying every
# other stream must not stall; `tokenizers` lets go of the GIL while it encodes a long text
# (`engine.tokenizer.encoding`).
OFFLOAD_BYTES = 16 * 1024


async def prompt_keys(
    keyer: PromptKeyer, path: str, body: dict[str, Any], body_bytes: int
) -> tuple[list[bytes], int]:
    """``keyer.keys(path, body)``, off the event loop when the body is large."""
    if body_bytes > OFFLOAD_BYTES:
        return await asyncio.to_thread(keyer.keys, path, body)
    return keyer.keys(path, body)


def make_keyer(
    model_dir: str | None,
    block_size: int,
    model_extra: Callable[[object], bytes] | None = None,
    chat_template: str | None = None,
    content_format: str = "auto",
    chat: ChatDefaults = ChatDefaults(),
) -> PromptKeyer:
    """``model_extra``: a body's ``model`` -> its block-hash salt (LoRA adapters)."""
    if model_dir:
        keyer: PromptKeyer = TokenKeyer.from_dir(model_dir, block_size, chat_template, content_format, chat)
    else:
        keyer = TextKeyer(block_size)
    if model_extra is not None:
        keyer.model_extra = model_extra
    return keyer
