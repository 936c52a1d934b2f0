"""``POST /pooling`` (vLLM's): the served pooling model's output for each input, as a plain vector.

On an embedding model (task ``embed``) an input's vector is its embedding, normalised unless the
request turns the activation off: the values ``/v1/embeddings`` answers. On a sequence classifier
(task ``classify``) it is the class probabilities by the config's activation (the raw logits without
it): the ``probs`` ``/classify`` answers. Either way the values are float32, encoded as
``/v1/embeddings`` encodes them (``float``; ``base64``, ``bytes`` or ``bytes_only`` in ``embed_dtype``
and ``endianness``: ``serving_embeddings.encoded_row`` and ``bytes_answer``). Inputs run as pooling
engine requests through ``serving_embeddings.answer_pooled`` (admitted together, batched, timed out,
aborted when the client leaves), with the same prompt checks and usage as the other pooling routes.
``dimensions`` is a 400 here, as vLLM answers it on this route (``/v1/embeddings`` takes it on
Matryoshka models).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

from fastapi.responses import Response

from engine.pooling import activate, normalized, truncated
from server.errors import bad_request
from server.pooling_protocol import PoolingData, PoolingRequest, PoolingResponse
from server.serving_embeddings import (
    answer_pooled,
    bytes_answer,
    encoded_row,
    planned_inputs,
    pooled_usage,
)
from server.state import ServerState


async def create_pooling(
    state: ServerState,
    req: PoolingRequest,
    request_id: str,
    receive: Any,
    submitted: Callable[[], None] | None = None,
) -> Response:
    arrival = time.perf_counter()
    await state.resolve_model(req.model)  # a LoRA adapter of --lora-resolver-dir, loaded on first use
    lora = state.check_model(req.model)
    classifier = getattr(getattr(state.engine, "model_info", None), "classifier", None)
    task = "classify" if classifier is not None else "embed"
    if req.task is not None and req.task != task:
        raise bad_request(
            f"task {req.task!r} is not served: this model's pooling task is {task!r}", param="task"
        )
    if req.dimensions is not None:
        raise bad_request(
            "dimensions is not supported on /pooling; /v1/embeddings takes it on Matryoshka models",
            param="dimensions",
        )
    if classifier is not None and req.normalize is not None:
        raise bad_request(
            "normalize applies to embedding models; a classifier's activation is use_activation",
            param="normalize",
        )
    # vLLM's precedence: normalize, then softmax, activation, use_activation (as /v1/embeddings').
    activated = req.normalize if req.normalize is not None else req.activated
    inputs = await planned_inputs(state, req)

    values: Callable[[list[float]], Any]
    if classifier is not None:
        values = partial(activate, kind=classifier.classify_activation if activated else "identity")
    else:
        values = normalized if activated else truncated

    def build(vectors: list[list[float]]) -> PoolingResponse | Response:
        rows = [values(v) for v in vectors]
        answer_id, usage, model = f"pool-{request_id}", pooled_usage(inputs), state.answer_model(lora)
        if req.encoding_format in ("bytes", "bytes_only"):
            return bytes_answer(rows, req, answer_id, model, usage)
        data = [PoolingData(index=i, data=encoded_row(row, req)) for i, row in enumerate(rows)]
        return PoolingResponse(id=answer_id, model=model, data=data, usage=usage)

    return await answer_pooled(state, inputs, lora, request_id, arrival, receive, submitted, build)
