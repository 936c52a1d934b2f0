"""Request and response models of vLLM's ``POST /pooling``: a pooling model's raw output per input
(``server/serving_pooling.py``). Torch-free, like ``server/protocol.py``.

A request gives ``input`` (a text, texts, token ids or lists of them, as ``/v1/embeddings``) or chat
``messages`` (rendered with the chat template, as ``/tokenize`` renders them; no generation prompt
unless asked, as vLLM's pooling chat requests), never both. ``use_activation`` (or its older
spellings ``activation`` / ``softmax``) says whether the model's activation is applied: an embedding's
L2 normalisation (``normalize`` too, ferry's ``/v1/embeddings`` spelling), a classifier's softmax or
sigmoid. ``task`` may only name the served model's own (``embed`` or ``classify``).
``encoding_format``, ``embed_dtype`` and ``endianness`` are ``/v1/embeddings``' (vLLM's ``float``,
``base64``, ``bytes`` and ``bytes_only``).
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import Field, StrictBool, StrictInt, StrictStr, model_validator

from server.chat_protocol import ChatMessage
from server.embedding_protocol import EmbeddingUsage, EmbedDType, Endianness, PoolingEncoding
from server.protocol import PromptInput, _Response
from server.score_protocol import _Activation


class PoolingRequest(_Activation):
    input: PromptInput | None = None
    messages: list[ChatMessage] | None = None
    encoding_format: PoolingEncoding = "float"
    embed_dtype: EmbedDType = "float32"
    endianness: Endianness = "native"
    task: StrictStr | None = None
    normalize: StrictBool | None = None
    dimensions: StrictInt | None = None  # refused by the serving layer, as vLLM's /pooling refuses it
    # Default: True for ``input``, False for ``messages`` (their template places the special tokens).
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = False
    continue_final_message: StrictBool = False
    chat_template: StrictStr | None = None
    chat_template_kwargs: dict | None = None

    @model_validator(mode="after")
    def _one_input(self) -> PoolingRequest:
        if (self.input is None) == (self.messages is None):
            raise ValueError("give exactly one of 'input' or 'messages'")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if self.add_special_tokens is None:
            self.add_special_tokens = self.messages is None
        return self


class PoolingData(_Response):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str  # float32 values, or base64 of their embed_dtype bytes


class PoolingResponse(_Response):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[PoolingData]
    usage: EmbeddingUsage
