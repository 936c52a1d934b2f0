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

from pydantic import Field, StrictBool, StrictInt, StrictStr

from server.embedding_protocol import EmbeddingUsage, EmbedDType, Endianness, PooledInput, PoolingEncoding
from server.protocol import _Response
from server.score_protocol import _Activation


class PoolingRequest(_Activation, PooledInput):
    encoding_format: PoolingEncoding = "float"
    embed_dtype: EmbedDType = "float32"
    endianness: Endianness = "native"
    task: StrictStr | None = None
    normalize: StrictBool | None = None
    dimensions: StrictInt | None = None  # refused by the serving layer, as vLLM's /pooling refuses it


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
