"""``POST /classify`` (vLLM's; also ``/v1/classify``) on a sequence-classification model
(``*ForSequenceClassification``: ``engine/classifier.py``).

A request gives ``input`` (texts or token ids, each classified) or chat ``messages`` (rendered with
the chat template into one prompt, as ``/pooling`` and ``/v1/embeddings`` take them: vLLM's
ClassificationChatRequest). Each input runs as a pooling engine request, exactly as an embedding does
(``serving_embeddings.answer_pooled``: admitted together, batched, timed out, aborted when the
client leaves); on a classifier the engine ends it with the score head's logits. An answer's
``probs`` are the activation the model's config names (softmax over the labels, the sigmoid for
one label; ``use_activation: false`` keeps the logits), its ``label`` the ``id2label`` name of the
largest, as vLLM answers. On a model that is not a classifier the route is a 400.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
from fastapi.responses import JSONResponse

from engine.classifier import ClassifierInfo
from engine.pooling import activate
from server.errors import bad_request
from server.score_protocol import ClassificationData, ClassificationRequest, ClassificationResponse
from server.serving_embeddings import answer_pooled, planned_inputs, pooled_usage
from server.state import ServerState


def served_classifier(state: ServerState) -> ClassifierInfo | None:
    """The served model's classifier facts (``ModelInfo.classifier``); None for a decoder."""
    return getattr(getattr(state.engine, "model_info", None), "classifier", None)


async def create_classification(
    state: ServerState,
    req: ClassificationRequest,
    request_id: str,
    receive: Any,
    submitted: Callable[[], None] | None = None,
) -> JSONResponse:
    arrival = time.perf_counter()
    await state.resolve_model(req.model)  # a LoRA adapter of --lora-resolver-dir, loaded on first use
    lora = state.check_model(req.model)
    info = served_classifier(state)
    if info is None:
        raise bad_request(
            "This model is not a sequence-classification model (*ForSequenceClassification): "
            "/classify needs one. Use /v1/embeddings, /score or /rerank.",
            param="model",
        )
    inputs = await planned_inputs(state, req)
    kind = info.classify_activation if req.activated else "identity"

    def build(logits: list[list[float]]) -> ClassificationResponse:
        data = []
        for i, row in enumerate(logits):
            probs = activate(row, kind)
            label = info.labels[int(np.argmax(probs))]
            data.append(ClassificationData(index=i, label=label, probs=probs.tolist(), num_classes=len(row)))
        return ClassificationResponse(
            id=f"classify-{request_id}", model=state.answer_model(lora), data=data, usage=pooled_usage(inputs)
        )

    return await answer_pooled(state, inputs, lora, request_id, arrival, receive, submitted, build)
