"""SageMaker's serving contract, as vLLM serves it: ``GET``/``POST /ping`` (the container's health
check) and ``POST /invocations`` (every request to one path, served by the endpoint whose request
it is).

vLLM tries each request type in turn and, when none validates, answers that it found no handler.
Here the body's distinguishing field picks the endpoint first (``messages``: chat completions,
``prompt``: completions, ``input``: embeddings, or classification on a classifier model,
``query``: rerank, ``text_1`` / ``data_1`` / ``queries``: score), so a mistake in a chat request is
answered with the chat endpoint's own 400 naming the field, not with "no handler".

vLLM tries only the request types of the tasks the model serves, and ignores a body's unknown fields:
on a classifier, which generates nothing, a chat-shaped body (``messages``) is classified (vLLM's
ClassificationChatRequest), one with ``input`` and ``messages`` classified by its ``input``
(``messages`` ignored), one with ``query`` and ``prompt`` reranked. So on a classifier ``prompt``
counts last: a body with nothing else still reaches completions, for its 400 saying the model does
not generate.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from server.chat_protocol import ChatCompletionRequest
from server.completion_protocol import CompletionRequest
from server.embedding_protocol import EmbeddingRequest
from server.errors import bad_request, validated
from server.score_protocol import ClassificationRequest, RerankRequest, ScoreRequest

# A body's distinguishing field -> the request it is (first match wins, in this order).
_KINDS: tuple[tuple[str, str], ...] = (
    ("messages", "chat"),
    ("prompt", "completion"),
    ("input", "pooling"),
    ("query", "rerank"),
    ("text_1", "score"),
    ("data_1", "score"),
    ("queries", "score"),
)
_GENERATION = frozenset({"chat", "completion"})
_MODELS: dict[str, type[BaseModel]] = {
    "chat": ChatCompletionRequest,
    "completion": CompletionRequest,
    "embedding": EmbeddingRequest,
    "classification": ClassificationRequest,
    "rerank": RerankRequest,
    "score": ScoreRequest,
}


def invocation(body: Any, classifier: bool) -> tuple[str, BaseModel]:
    """(the endpoint's kind, the validated request) for an ``/invocations`` body; a 400 when the
    body is none of them or is not valid as the one it is."""
    if not isinstance(body, dict):
        raise bad_request("an /invocations body must be a JSON object")
    kinds = [k for field, k in _KINDS if field in body]
    if classifier:  # chat-shaped bodies are classified; stable: pooling kinds first, in order
        kinds = ["pooling" if k == "chat" else k for k in kinds]
        kinds.sort(key=lambda k: k in _GENERATION)
        if "input" in body:  # classified by its input, messages ignored (as vLLM's union reads it)
            body = {k: v for k, v in body.items() if k != "messages"}
    kind = kinds[0] if kinds else None
    if kind is None:
        raise bad_request(
            "Cannot tell which endpoint this /invocations body is for: give 'messages' (chat "
            "completions), 'prompt' (completions), 'input' (embeddings, or classification on a "
            "classifier), 'query' and 'documents' (rerank), or 'text_1' and 'text_2' (score)"
        )
    if kind == "pooling":
        kind = "classification" if classifier else "embedding"
    return kind, validated(_MODELS[kind], body)
