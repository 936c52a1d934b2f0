"""``POST /score`` and ``POST /rerank`` (vLLM's scoring endpoints), as vLLM serves them:

* on a model that embeds, bi-encoder scoring: a pair's score is the cosine similarity of its two
  texts' embeddings (the dot product of their L2-normalised vectors, in float64);
* on a one-label sequence classifier (a cross-encoder reranker such as bge-reranker-v2-gemma or a
  Qwen3-Reranker seq-cls conversion), each pair is one input, built by
  ``engine.classifier.pair_prompt`` (the tokenizer's pair encoding, the texts joined when the config
  says ``use_sep_token: false``, or the ``--chat-template`` as vLLM's score template), its score
  the config's activation of the logit (the sigmoid by default); ``truncate_prompt_tokens`` cuts a
  pair as transformers' truncation does. A classifier with more labels answers 400, as vLLM
  enables scoring for ``num_labels == 1`` only.

For a bi-encoder, every distinct text of a request is embedded once, through the same pooling engine requests as
``/v1/embeddings`` (``serving_embeddings.answer_pooled``: admitted together, batched with the rest,
timed out, aborted when the client leaves); a query scored against every document is computed
once, and so counted once in ``usage``, which is the tokens of the texts embedded. A cross-encoder's
``usage`` is the tokens of its pair prompts.

Pairing follows vLLM: one text on the first side scores against each text of the second (1:N),
N texts against N pair up in order (N:N); any other shape is a 400 naming the second field. A
rerank is the 1:N case with its results sorted by score, highest first (ties in document order),
cut to ``top_n``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from fastapi.responses import JSONResponse

from engine.classifier import ClassifierInfo, pair_prompt
from engine.pooling import activate, normalized
from server.errors import bad_request
from server.prompts import kept_prompt_tokens
from server.score_protocol import (
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from server.serving_classify import served_classifier
from server.serving_common import plan_off_loop, prompt_chars
from server.serving_embeddings import (
    MAX_INPUTS,
    answer_pooled,
    pooled_usage,
    pooling_context,
    pooling_prompt,
    too_long,
)
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
    state: ServerState, sides: Sequence[tuple[str, Sequence[str]]], keep: int | None
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
                        state, text, add_special_tokens=True, keep=keep, param=param, what="a text"
                    )
                )
            row.append(at)
        positions.append(row)
    return prompts, positions


def _pair_prompts(
    state: ServerState,
    info: ClassifierInfo,
    pairs: Sequence[tuple[str, str]],
    keep: int | None,
    param: str,
) -> list[list[int]]:
    """A cross-encoder's prompt for each pair (400 naming ``param`` for one past the context)."""
    if not info.scores_pairs:
        raise bad_request(
            f"This classifier has {info.num_labels} labels: scoring and reranking are served by "
            "one-label classifiers (cross-encoders) only. Use /classify.",
            param="model",
        )
    context = pooling_context(state)
    template = getattr(getattr(state.engine, "config", None), "chat_template", None)
    prompts = []
    for first, second in pairs:
        try:
            ids = pair_prompt(
                state.tokenizer,
                first,
                second,
                use_sep_token=info.use_sep_token,
                template=template,
                max_length=keep,
            )
        except ValueError as e:  # a template that cannot render the pair, a cut below the special tokens
            raise bad_request(str(e), param="truncate_prompt_tokens" if keep else param) from e
        if len(ids) > context:
            raise too_long("a pair", len(ids), context, param)
        prompts.append(ids)
    return prompts


def _cross_scores(kind: str, logits: list[list[float]]) -> list[float]:
    return [float(activate(row, kind)[0]) for row in logits]


def _paired(firsts: list[Any], seconds: list[Any]) -> list[tuple[Any, Any]]:
    """vLLM's pairing: one first against each second (1:N), else N:N in order."""
    return list(zip(firsts * len(seconds) if len(firsts) == 1 else firsts, seconds, strict=True))


def _plan(
    state: ServerState,
    sides: Sequence[tuple[str, Sequence[str]]],
    keep: int | None,
    activated: bool = True,
) -> tuple[list[list[int]], Callable[[list[list[float]]], list[float]]]:
    """A request's pooling prompts, and what turns their results into the pairs' scores (in pair
    order): a cross-encoder's prompt per pair (its logit through the config's activation, unless
    ``use_activation`` is false), or a bi-encoder's per distinct text."""
    (_, texts_1), (param, texts_2) = sides
    info = served_classifier(state)
    if info is not None:
        prompts = _pair_prompts(state, info, _paired(list(texts_1), list(texts_2)), keep, param)
        return prompts, functools.partial(_cross_scores, info.score_activation if activated else "identity")
    prompts, (left, right) = _distinct_prompts(state, sides, keep)
    return prompts, functools.partial(_cosines, pairs=_paired(left, right))


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
    await state.resolve_model(req.model)  # a LoRA adapter of --lora-resolver-dir, loaded on first use
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
    sides = [(first, texts_1), (second, texts_2)]
    keep = kept_prompt_tokens(req, state.limits)
    prompts, scores_of = await plan_off_loop(prompt_chars(sides), _plan, state, sides, keep, req.activated)

    def build(results: list[list[float]]) -> ScoreResponse:
        return ScoreResponse(
            id=f"score-{request_id}",
            model=state.answer_model(lora),
            data=[ScoreData(index=i, score=s) for i, s in enumerate(scores_of(results))],
            usage=pooled_usage(prompts),
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
    await state.resolve_model(req.model)  # a LoRA adapter of --lora-resolver-dir, loaded on first use
    lora = state.check_model(req.model)
    documents = [req.documents] if isinstance(req.documents, str) else list(req.documents)
    _check_side("query", [req.query])
    _check_side("documents", documents)
    sides = [("query", [req.query]), ("documents", documents)]
    keep = kept_prompt_tokens(req, state.limits)
    prompts, scores_of = await plan_off_loop(prompt_chars(sides), _plan, state, sides, keep, req.activated)

    def build(results: list[list[float]]) -> RerankResponse:
        scores = scores_of(results)
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
            id=f"rerank-{request_id}",
            model=state.answer_model(lora),
            usage=pooled_usage(prompts),
            results=results,
        )

    return await answer_pooled(state, prompts, lora, request_id, arrival, receive, submitted, build)
