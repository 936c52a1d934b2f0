"""OpenAI's ``/v1/embeddings``: the request, its vector encodings and its answer
(``server/serving_embeddings.py``), and the usage every pooling route answers with.

``/pooling`` and ``/score`` / ``/classify`` (``pooling_protocol``, ``score_protocol``) reuse the
encodings and ``EmbeddingUsage``; ``engine.pooling.encode_values`` does the encoding. Torch-free,
like ``server.protocol``.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import Field, StrictBool, StrictInt, StrictStr, field_validator, model_validator

from server.chat_protocol import ChatMessage
from server.protocol import PromptInput, _Request, _Response, truncation

# ----------------------------------------------------------------- requests


# vLLM's binary encodings of pooled vectors (``engine.pooling.encode_values``): the dtype the float32
# values are cast to and the byte order, for ``base64`` and the raw ``bytes`` / ``bytes_only`` answers.
EmbedDType = Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"]
Endianness = Literal["native", "big", "little"]
PoolingEncoding = Literal["float", "base64", "bytes", "bytes_only"]


class PooledInput(_Request):
    """What a pooling request pools: ``input`` (a text, texts, token ids or lists of them) or chat
    ``messages``, never both: vLLM's chat-shaped embedding and pooling requests, rendered with the
    chat template as ``/tokenize`` renders them (no generation prompt unless asked) into one prompt.
    ``add_special_tokens`` defaults to True for ``input``, False for ``messages`` (their template
    places the special tokens), as vLLM's."""

    input: PromptInput | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = False
    continue_final_message: StrictBool = False
    chat_template: StrictStr | None = None
    chat_template_kwargs: dict | None = None

    @model_validator(mode="after")
    def _one_input(self) -> PooledInput:
        if self.input is None and self.messages is None:
            raise ValueError("input: is required: give exactly one of 'input' or 'messages'")
        if self.input is not None and self.messages is not None:
            raise ValueError("messages: give exactly one of 'input' or 'messages', not both")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if self.add_special_tokens is None:
            self.add_special_tokens = self.messages is None
        return self


class EmbeddingRequest(PooledInput):
    """OpenAI's /v1/embeddings (plus vLLM's ``messages``, ``truncate_prompt_tokens``,
    ``add_special_tokens``, ``normalize`` / ``use_activation``, ``embed_dtype``, ``endianness`` and
    the ``bytes`` encodings)."""

    model: StrictStr | None = None
    encoding_format: PoolingEncoding = "float"
    embed_dtype: EmbedDType = "float32"
    endianness: Endianness = "native"
    dimensions: StrictInt | None = Field(default=None, ge=1)
    user: StrictStr | None = None
    truncate_prompt_tokens: StrictInt | None = Field(default=None, ge=-1)
    normalize: StrictBool | None = None  # False: the pooled state as it is (vLLM's pooling parameter)
    use_activation: StrictBool | None = None  # vLLM's newer spelling of normalize

    _check_truncation = field_validator("truncate_prompt_tokens")(truncation)

    @property
    def normalized(self) -> bool:
        """Whether the vector is L2-normalised. ``normalize`` wins over ``use_activation`` when
        both are given, as in vLLM (its older spelling first, on every pooling route: ``/pooling``
        too); True when neither is."""
        for flag in (self.normalize, self.use_activation):
            if flag is not None:
                return flag
        return True


# ----------------------------------------------------------------- responses


class EmbeddingData(_Response):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # float32 values, or base64 of their embed_dtype bytes


class EmbeddingUsage(_Response):
    """A pooling answer's usage (embeddings, /pooling, /classify, /score): vLLM's ``UsageInfo`` as
    its pooling routes answer it, ``completion_tokens`` 0 and ``prompt_tokens_details`` null. A
    rerank answers the first two only, as vLLM's ``RerankUsage`` (``serving_embeddings``)."""

    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0
    prompt_tokens_details: None = None


class EmbeddingResponse(_Response):
    """vLLM's embeddings answer: OpenAI's fields plus ``id`` (``embd-`` and the request id, as the
    ``bytes`` metadata's) and ``created``, which OpenAI's SDKs keep as extra fields."""

    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
