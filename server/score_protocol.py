"""Request and response models of vLLM's scoring endpoints: ``/score`` (also ``/v1/score``) and the
Jina/Cohere-style ``/rerank`` (also ``/v1/rerank``, ``/v2/rerank``); and of its ``/classify``
(also ``/v1/classify``), which shares their pooling fields.

A score request names its two sides in any of vLLM's spellings: ``text_1``/``text_2`` (the
original), ``data_1``/``data_2``, ``queries``/``documents`` or ``queries``/``items``; exactly one
pair. Each side is a string or a list of strings (text only: no multimodal content parts).
Pairing rules and list limits are checked by the serving layer (``server/serving_score.py``), which
names the field the client used. Torch-free, like ``server/protocol.py``.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field, StrictBool, StrictInt, StrictStr, field_validator, model_validator

from server.embedding_protocol import EmbeddingUsage, PooledInput
from server.protocol import _Request, _Response, truncation

Texts = StrictStr | list[StrictStr]

# The second field of each spelling -> its first field. ``queries`` pairs with two.
_FIRST_OF = {"text_2": "text_1", "data_2": "data_1", "documents": "queries", "items": "queries"}
_FIRSTS = ("text_1", "data_1", "queries")


class _PoolingFields(_Request):
    model: StrictStr | None = None
    user: StrictStr | None = None
    # vLLM's: keep the last N tokens of each text; -1 keeps the model's context length.
    truncate_prompt_tokens: StrictInt | None = Field(default=None, ge=-1)

    _check_truncation = field_validator("truncate_prompt_tokens")(truncation)


class _Activation(_PoolingFields):
    # vLLM's: false gives a classifier head's logits as they are (no softmax or sigmoid);
    # ``activation`` and ``softmax`` are its older spellings (which win, in that order, when given).
    use_activation: StrictBool | None = None
    activation: StrictBool | None = None
    softmax: StrictBool | None = None

    @property
    def activated(self) -> bool:
        chosen = [v for v in (self.softmax, self.activation, self.use_activation) if v is not None]
        return chosen[0] if chosen else True


class ScoreRequest(_Activation):
    text_1: Texts | None = None
    text_2: Texts | None = None
    data_1: Texts | None = None
    data_2: Texts | None = None
    queries: Texts | None = None
    documents: Texts | None = None
    items: Texts | None = None

    @model_validator(mode="after")
    def _one_pair(self) -> ScoreRequest:
        firsts = [name for name in _FIRSTS if getattr(self, name) is not None]
        seconds = [name for name in _FIRST_OF if getattr(self, name) is not None]
        if len(firsts) > 1 or len(seconds) > 1:
            extra = (firsts if len(firsts) > 1 else seconds)[1]
            raise ValueError(
                f"{extra}: give one pair of fields (text_1 and text_2, data_1 and data_2, queries "
                "and documents, or queries and items), not several"
            )
        if not firsts and not seconds:
            raise ValueError(
                "text_1: is required: the texts to score as text_1 and text_2 (or data_1 and data_2, "
                "queries and documents, queries and items)"
            )
        if not seconds:
            second = {"text_1": "text_2", "data_1": "data_2", "queries": "documents"}[firsts[0]]
            raise ValueError(f"{second}: is required with {firsts[0]}")
        if not firsts:
            raise ValueError(f"{_FIRST_OF[seconds[0]]}: is required with {seconds[0]}")
        if _FIRST_OF[seconds[0]] != firsts[0]:
            raise ValueError(f"{seconds[0]}: pairs with {_FIRST_OF[seconds[0]]}, not with {firsts[0]}")
        return self

    def sides(self) -> tuple[tuple[str, list[str]], tuple[str, list[str]]]:
        """``((first field name, its texts), (second field name, its texts))`` as the client sent them."""
        second = next(name for name in _FIRST_OF if getattr(self, name) is not None)
        first = _FIRST_OF[second]
        return (first, _as_list(getattr(self, first))), (second, _as_list(getattr(self, second)))


class ClassificationRequest(_Activation, PooledInput):
    """vLLM's ``/classify``: texts or token ids, each classified on its own, or chat ``messages``
    classified as the one prompt the chat template renders (vLLM's ClassificationChatRequest)."""


class RerankRequest(_Activation):
    query: StrictStr
    documents: Texts
    top_n: StrictInt = Field(default=0, ge=0)  # 0: every document
    return_documents: StrictBool = True


def _as_list(texts: Any) -> list[str]:
    return [texts] if isinstance(texts, str) else list(texts)


def _absent(value: object) -> bool:
    return value is None


class ScoreData(_Response):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(_Response):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: EmbeddingUsage


class RerankDocument(_Response):
    text: str


class RerankResult(_Response):
    index: int
    document: RerankDocument | None = Field(default=None, exclude_if=_absent)  # return_documents=false
    relevance_score: float


class RerankResponse(_Response):
    id: str
    model: str
    usage: EmbeddingUsage
    results: list[RerankResult]


class ClassificationData(_Response):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(_Response):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ClassificationData]
    usage: EmbeddingUsage
