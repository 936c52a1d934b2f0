"""POST /v1/embeddings: each input's pooled hidden state, L2-normalised (last-token pooling by
default, the embedding of decoder models such as Qwen3-Embedding or e5-mistral, as vLLM pools them;
mean or first-token pooling by ``--pooling-type`` or the model's sentence-transformers config:
``engine/pooler.py``).

Inputs run as engine requests that end once their prompt is computed (``pooling=True``): they are
admitted, batched, prefix-cached, timed out and aborted on disconnect like generation requests.
``dimensions`` keeps the first N values before normalising, on Matryoshka models only
(``check_dimensions``: a 400 on any other, as vLLM answers). Encodings, as vLLM's: ``float`` lists
the float32 values; ``base64`` carries them cast to ``embed_dtype`` (float32 by default, as OpenAI's
SDKs decode it) in ``endianness``'s byte order (native by default); ``bytes`` answers those bytes
as the body, every vector after the other, with a ``metadata`` header saying where each lies
(``bytes_only``: without it). A JSON answer carries vLLM's ``id`` (``embd-`` and the request id,
the ``metadata``'s too) and ``created``. ``normalize: false`` or ``use_activation: false`` gives the
pooled state unnormalised (``normalize`` wins when both are given, as in vLLM and on ``/pooling``).
Chat ``messages`` instead of ``input`` (vLLM's chat-shaped pooling requests) are rendered with the
chat template into one prompt (``chat_inputs``), on ``/pooling`` and ``/classify`` too.
``pooling_prompt`` and ``answer_pooled`` serve ``/score``, ``/rerank``, ``/classify`` and
``/pooling`` too, so every pooled text takes this path.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from engine.outputs import RequestOutput
from engine.pooling import encode_values, float32_values, normalized, truncated
from engine.sampling_params import SamplingParams
from server.embedding_protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    PooledInput,
)
from server.errors import bad_request, unavailable
from server.params import check_token_ids
from server.prompts import chat_prompt, kept_prompt_tokens
from server.score_protocol import RerankResponse
from server.sequence_request import SequenceRequest
from server.serving_common import answer_whole, plan_off_loop, prompt_chars
from server.state import ServerState

MAX_INPUTS = 2048  # per request, as OpenAI allows


def pooling_context(state: ServerState) -> int:
    """The most tokens one pooled input may have: the context ``/v1/models`` advertises (the KV
    cache's tokens per sequence when they are fewer than ``max_model_len``), so that a longer input is
    this layer's 400 naming the input rather than the engine's refusal of its KV blocks."""
    return state.limits.kv_capacity_tokens


def pooling_prompt(
    state: ServerState,
    item: str | list[int],
    *,
    add_special_tokens: bool,
    keep: int | None,
    param: str,
    what: str = "an input",
) -> list[int]:
    """One text's (or token list's) prompt for a pooling request: checked, cut to its last ``keep``
    tokens (``prompts.kept_prompt_tokens``: ``truncate_prompt_tokens`` resolved), and no longer than
    the context (400 naming ``param`` otherwise)."""
    if isinstance(item, str):
        ids = state.tokenizer.encode(item, add_special_tokens=add_special_tokens)
    else:
        ids = list(item)
        check_token_ids(ids, state.limits, param)
    if not ids:
        raise bad_request(f"{param} must not contain empty strings or token lists", param=param)
    if keep is not None:
        ids = ids[-keep:]
    context = pooling_context(state)
    if len(ids) > context:
        raise too_long(what, len(ids), context, param)
    return ids


def too_long(what: str, tokens: int, context: int, param: str) -> Exception:
    """The 400 for a pooled input past the context: OpenAI's ``context_length_exceeded``, its
    message opening as OpenAI's and vLLM's do ("This model's maximum context length is"), which
    clients such as LiteLLM and LangChain match to tell an over-long input from other 400s."""
    return bad_request(
        f"This model's maximum context length is {context} tokens, but {what} has {tokens} tokens. "
        "Shorten it or set truncate_prompt_tokens.",
        param=param,
        code="context_length_exceeded",
    )


def pooling_inputs(state: ServerState, req: EmbeddingRequest | Any) -> list[list[int]]:
    """The prompts of a request's ``input`` (a text, texts, token ids or lists of them), each checked
    and truncated by ``pooling_prompt`` (``add_special_tokens``, ``truncate_prompt_tokens``)."""
    raw = req.input
    if isinstance(raw, str):
        items: list[Any] = [raw]
    elif raw and isinstance(raw[0], int):
        items = [list(raw)]
    else:
        items = list(raw)
    if not items:
        raise bad_request("input must not be empty", param="input")
    if len(items) > MAX_INPUTS:
        raise bad_request(f"input has {len(items)} items; at most {MAX_INPUTS} are allowed", param="input")
    keep = kept_prompt_tokens(req, state.limits)
    return [
        pooling_prompt(state, item, add_special_tokens=req.add_special_tokens, keep=keep, param="input")
        for item in items
    ]


def chat_inputs(state: ServerState, req: PooledInput) -> list[list[int]]:
    """The one prompt of a ``messages`` request: rendered and truncated as a chat request's, then
    held to the context like every pooled input."""
    if any(m.image_urls for m in req.messages or ()):
        raise bad_request("image content parts are not supported on pooling routes", param="messages")
    ids = chat_prompt(
        req,  # type: ignore[arg-type]
        state.tokenizer,
        state.config.trust_request_chat_template,
        state.config.chat,
        state.limits,
    )
    return [
        pooling_prompt(state, ids, add_special_tokens=False, keep=None, param="messages", what="the prompt")
    ]


async def planned_inputs(state: ServerState, req: PooledInput) -> list[list[int]]:
    """A pooling request's prompts, planned off the event loop: its ``messages`` rendered as one
    prompt (``chat_inputs``), or each of its ``input`` items (``pooling_inputs``)."""
    if req.messages is not None:
        return await plan_off_loop(prompt_chars(req.messages), chat_inputs, state, req)
    return await plan_off_loop(prompt_chars(req.input), pooling_inputs, state, req)


def pooled_usage(prompts: list[list[int]]) -> EmbeddingUsage:
    """A pooling answer's usage: the tokens of the prompts it computed."""
    tokens = sum(len(ids) for ids in prompts)
    return EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)


def encoded_row(values: np.ndarray, req: Any) -> list[float] | str:
    """One pooled vector as a JSON answer carries it (``req``: an embeddings or pooling request):
    its float32 values, or for ``base64`` their ``embed_dtype`` bytes in ``endianness``'s order."""
    if req.encoding_format == "base64":
        return base64.b64encode(encode_values(values, req.embed_dtype, req.endianness)).decode("ascii")
    return float32_values(values)


def bytes_answer(
    rows: list[np.ndarray], req: Any, answer_id: str, model: str, usage: EmbeddingUsage
) -> Response:
    """vLLM's binary answer (``encoding_format`` ``bytes`` or ``bytes_only``): each vector's
    ``embed_dtype`` bytes, one after another, as the body; with ``bytes`` a ``metadata`` header (JSON:
    the answer's id, created, model, usage and, per vector, its index, embed_dtype, endianness,
    byte ``start`` and ``end`` in the body and ``shape``)."""
    chunks = [encode_values(row, req.embed_dtype, req.endianness) for row in rows]
    headers = None
    if req.encoding_format == "bytes":
        items, start = [], 0
        for i, (row, chunk) in enumerate(zip(rows, chunks, strict=True)):
            end = start + len(chunk)
            items.append(
                {
                    "index": i,
                    "embed_dtype": req.embed_dtype,
                    "endianness": req.endianness,
                    "start": start,
                    "end": end,
                    "shape": [len(row)],
                }
            )
            start = end
        meta = {
            "id": answer_id,
            "created": int(time.time()),
            "model": model,
            "data": items,
            "usage": {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.total_tokens},
        }
        headers = {"metadata": json.dumps(meta)}
    return Response(b"".join(chunks), media_type="application/octet-stream", headers=headers)


class _Built(BaseModel):
    """What ``answer_whole`` renders for ``answer_pooled``, which answers itself."""


# vLLM's rerank usage is its RerankUsage: the prompt and total tokens only.
_RERANK_DUMP: dict[str, Any] = {"exclude": {"usage": {"completion_tokens", "prompt_tokens_details"}}}


async def answer_pooled(
    state: ServerState,
    prompts: list[list[int]],
    lora: Any,
    request_id: str,
    arrival: float,
    receive: Any,
    submitted: Callable[[], None] | None,
    build: Callable[[list[list[float]]], Any],
) -> Response:
    """Run each prompt as a pooling engine request (admitted together: 429/503 before any starts;
    timed out, aborted on disconnect) and answer ``build(vectors)``: the pooled hidden states in
    ``prompts``' order, as the engine left them (not normalised); a response model (as JSON) or a
    ready ``Response`` (``bytes_answer``)."""
    params = SamplingParams(max_tokens=1)
    seqs = [
        SequenceRequest(
            choice_index=i, prompt_index=i, prompt_token_ids=ids, params=params, pooling=True, lora=lora
        )
        for i, ids in enumerate(prompts)
    ]
    ticket = state.generation.admit(len(seqs), submitted, pooling=True)
    vectors: list[list[float] | None] = [None] * len(seqs)
    built: list[Any] = []

    def on_output(seq: SequenceRequest, out: RequestOutput) -> None:
        if out.finished and out.embedding is not None:
            vectors[seq.choice_index] = out.embedding

    def finish() -> Any:
        if any(v is None for v in vectors):  # ended without a result: the engine is stopping
            raise unavailable("The engine ended an embedding request before computing it.")
        built.append(build(vectors))  # type: ignore[arg-type]
        return _Built()

    await answer_whole(state, seqs, request_id, arrival, ticket, receive, on_output, finish, lambda _: None)
    answer = built[0]
    if isinstance(answer, Response):
        return answer
    return JSONResponse(answer.model_dump(**(_RERANK_DUMP if isinstance(answer, RerankResponse) else {})))


def check_dimensions(state: ServerState, info: Any, dimensions: int) -> None:
    """``dimensions`` as vLLM allows it: only on a Matryoshka model (``ModelInfo.matryoshka``, read
    once at load: ``engine/pooler.py``), only a size its ``matryoshka_dimensions`` lists when it lists
    them, and never more than the model's hidden size; a 400 naming ``dimensions`` otherwise."""
    matryoshka = getattr(info, "matryoshka", None)
    if matryoshka is None:
        raise bad_request(
            f'Model "{state.model_name}" does not support matryoshka representation: its embeddings '
            "cannot be cut to fewer dimensions (leave out dimensions)",
            param="dimensions",
        )
    allowed = matryoshka.dimensions
    if allowed is not None and dimensions not in allowed:
        raise bad_request(
            f'Model "{state.model_name}" supports only the matryoshka dimensions '
            f"{', '.join(map(str, allowed))}, not {dimensions}",
            param="dimensions",
        )
    hidden = int(getattr(info, "hidden_size", 0) or 0)
    if hidden and dimensions > hidden:
        raise bad_request(
            f"dimensions={dimensions} is more than this model's {hidden} embedding dimensions",
            param="dimensions",
        )


async def create_embedding(
    state: ServerState,
    req: EmbeddingRequest,
    request_id: str,
    receive: Any,
    submitted: Callable[[], None] | None = None,
) -> object:
    arrival = time.perf_counter()
    await state.resolve_model(req.model)  # a LoRA adapter of --lora-resolver-dir, loaded on first use
    lora = state.check_model(req.model)
    info = getattr(state.engine, "model_info", None)
    if getattr(info, "classifier", None) is not None:
        raise bad_request(
            f"This model is a sequence classifier: it has no embeddings. Use {info.classifier.routes}.",
            param="model",
        )
    if req.dimensions is not None:
        check_dimensions(state, info, req.dimensions)
    inputs = await planned_inputs(state, req)
    values = normalized if req.normalized else truncated

    def build(vectors: list[list[float]]) -> EmbeddingResponse | Response:
        rows = [values(v, req.dimensions) for v in vectors]
        answer_id, usage, model = f"embd-{request_id}", pooled_usage(inputs), state.answer_model(lora)
        if req.encoding_format in ("bytes", "bytes_only"):
            return bytes_answer(rows, req, answer_id, model, usage)
        data = [EmbeddingData(index=i, embedding=encoded_row(row, req)) for i, row in enumerate(rows)]
        return EmbeddingResponse(id=answer_id, data=data, model=model, usage=usage)

    return await answer_pooled(state, inputs, lora, request_id, arrival, receive, submitted, build)
