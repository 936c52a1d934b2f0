"""``POST /score`` and ``POST /rerank`` (vLLM's scoring endpoints) for embedding models: bi-encoder
scoring, as vLLM serves it for a model that embeds. A pair's score is the cosine similarity of its
two texts' embeddings: the dot product of their L2-normalised vectors, in float64.

Every distinct text of a request is embedded once, through the same pooling engine requests as
``/v1/embeddings`` (``serving_embeddings.answer_pooled``: admitted together, batched with the rest,
timed out, aborted when the client leaves); a query scored against every document is computed
once, and so counted once in ``usage``, which is the tokens of the texts embedded.

Pairing follows vLLM: one text on the first side scores against each text of the second (1:N),
N texts against N pair up in order (N:N); any other shape is a 400 naming the second field. A
rerank is the 1:N case with its results sorted by score, highest first (ties in document order),
cut to ``top_n``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from fastapi.responses import JSONResponse

from engine.pooling import normalized
from server.errors import bad_request
from server.protocol import EmbeddingUsage
from server.score_protocol import (
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from server.serving_embeddings import MAX_INPUTS, answer_pooled, pooling_prompt
from server.state import ServerState

MAX_TEXTS = MAX_INPUTS  # per side: texts to score against, documents to rank


def _check_side(param: str, texts: Sequence[str]) -> None:
    if not texts:
        raise bad_request(f"{param} must not be empty", param=param)
    if len(texts) > MAX_TEXTS:
        raise bad_request(f"{param} has {len(texts)} texts; at most {MAX_TEXTS} are allowed", param=param)
    if any(text == "" for text in texts):
        what = "be an empty string" if len(texts) == 1 else "contain empty strings"
        raise bad_request(f"{param} must not {what}", param=param)


def _distinct_prompts(
    state: ServerState, sides: Sequence[tuple[str, Sequence[str]]], truncate: int | None
) -> tuple[list[list[int]], list[list[int]]]:
    """The token ids of each distinct text of the request (in order of first appearance), and for
    each side the position of each of its texts among them."""
    prompts: list[list[int]] = []
    seen: dict[str, int] = {}
    positions = []
    for param, texts in sides:
        row = []
        for text in texts:
            at = seen.get(text)
            if at is None:
                at = seen[text] = len(prompts)
                prompts.append(
                    pooling_prompt(
                        state, text, add_special_tokens=True, truncate=truncate, param=param, what="a text"
                    )
                )
            row.append(at)
        positions.append(row)
    return prompts, positions


def _usage(prompts: list[list[int]]) -> EmbeddingUsage:
    tokens = sum(len(ids) for ids in prompts)
    return EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)


def _cosines(vectors: list[list[float]], pairs: Sequence[tuple[int, int]]) -> list[float]:
    """Each pair's cosine similarity (vectors normalised once each; a zero vector scores 0)."""
    unit = [normalized(v) for v in vectors]
    return [float(np.dot(unit[a], unit[b])) for a, b in pairs]


async def create_score(
    state: ServerState,
    req: ScoreRequest,
    request_id: str,
    receive: Any,
    submitted: Callable[[], None] | None = None,
) -> JSONResponse:
    arrival = time.perf_counter()
    lora = state.check_model(req.model)
    (first, texts_1), (second, texts_2) = req.sides()
    _check_side(first, texts_1)
    _check_side(second, texts_2)
    if len(texts_1) > 1 and len(texts_1) != len(texts_2):
        raise bad_request(
            f"{first} has {len(texts_1)} texts and {second} has {len(texts_2)}: give one {first} "
            f"text to score against every {second} text, or as many of each to score in pairs",
            param=second,
        )
    prompts, (left, right) = _distinct_prompts(
        state, [(first, texts_1), (second, texts_2)], req.truncate_prompt_tokens
    )
    pairs = list(zip(left * len(right) if len(left) == 1 else left, right, strict=True))

    def build(vectors: list[list[float]]) -> ScoreResponse:
        scores = _cosines(vectors, pairs)
        return ScoreResponse(
            id=f"score-{request_id}",
            model=state.answer_model(lora),
            data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
            usage=_usage(prompts),
        )

    return await answer_pooled(state, prompts, lora, request_id, arrival, receive, submitted, build)


async def create_rerank(
    state: ServerState,
    req: RerankRequest,
    request_id: str,
    receive: Any,
    submitted: Callable[[], None] | None = None,
) -> JSONResponse:
    arrival = time.perf_counter()
    lora = state.check_model(req.model)
    documents = [req.documents] if isinstance(req.documents, str) else list(req.documents)
    _check_side("query", [req.query])
    _check_side("documents", documents)
    prompts, ((query,), docs) = _distinct_prompts(
        state, [("query", [req.query]), ("documents", documents)], req.truncate_prompt_tokens
    )

    def build(vectors: list[list[float]]) -> RerankResponse:
        scores = _cosines(vectors, [(query, d) for d in docs])
        ranked = sorted(range(len(documents)), key=lambda i: -scores[i])  # stable: ties keep order
        if req.top_n:
            ranked = ranked[: req.top_n]
        results = [
            RerankResult(
                index=i,
                document=RerankDocument(text=documents[i]) if req.return_documents else None,
                relevance_score=scores[i],
            )
            for i in ranked
        ]
        return RerankResponse(
            id=f"rerank-{request_id}", model=state.answer_model(lora), usage=_usage(prompts), results=results
        )

    return await answer_pooled(state, prompts, lora, request_id, arrival, receive, submitted, build)
