"""vLLM's token-level routes: render a request without generating, and generate from token ids.

* ``POST /v1/chat/completions/render`` and ``POST /v1/completions/render``: what a chat or
  completion request would hand the engine, as vLLM's ``GenerateRequest`` (one for a chat, a list
  of them, one per prompt, for completions): the prompt's token ids and the sampling parameters,
  nothing generated. They are planned by the very functions the generation routes use
  (``plan_chat``, ``plan_completion``), so the ids equal the ``prompt_token_ids`` a real request
  runs with (its template, tools, ``add_generation_prompt``/``continue_final_message``,
  truncation) and every 400 a real request would get is given here too.
* ``POST /inference/v1/generate``: vLLM's tokens-in, tokens-out route of disaggregated serving,
  whose body is the shape render answers (``server/token_generate.py``).
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from engine.sampling_params import SamplingParams
from server.chat_plan import plan_chat
from server.chat_protocol import ChatCompletionRequest
from server.completion_protocol import CompletionRequest
from server.errors import bad_request
from server.images import check_images
from server.protocol import ErrorResponse
from server.sequence_request import SequenceRequest
from server.serving_common import plan_off_loop, prompt_chars
from server.serving_completions import plan_completion
from server.state import ServerState
from server.token_generate import SAMPLING_FIELDS, GenerateRequest, generate
from server.token_offsets import token_offsets
from server.tools import plan_tools
from server.vllm_flags import apply_request_defaults

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 408, 413, 429, 503)
}


def add_token_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/chat/completions/render", responses=_ERRORS)
    async def render_chat_route(body: ChatCompletionRequest) -> Any:
        return JSONResponse(await render_chat(state, body))

    @app.post("/v1/completions/render", responses=_ERRORS)
    async def render_completion_route(body: CompletionRequest) -> Any:
        return JSONResponse(await render_completion(state, body))

    @app.post("/inference/v1/generate", responses=_ERRORS)
    async def generate_route(body: GenerateRequest, request: Request) -> Any:
        # vLLM names the answer after the X-Request-Id header, else the body's request_id.
        named = request.state.request_id if "x-request-id" in request.headers else body.request_id
        return await generate(
            state,
            body,
            request.state.request_id,
            request.receive,
            getattr(request.state, "submitted", None),
            named,
        )


# --- render ------------------------------------------------------------------------------------


def rendered_params(params: SamplingParams) -> dict[str, Any]:
    """An engine request's sampling parameters in vLLM's ``SamplingParams`` names (what
    ``/inference/v1/generate`` takes back)."""
    out: dict[str, Any] = {}
    for name in sorted(SAMPLING_FIELDS):
        value = getattr(params, name, None)
        if name == "structured_outputs" and value is not None:
            value = {
                k: list(v) if isinstance(v, tuple) else v
                for k, v in dataclasses.asdict(value).items()
                if v not in (None, False) and k != "after_token_id"
            }
        elif name == "repetition_detection" and value is not None:
            value = dataclasses.asdict(value)
        elif name == "logit_bias" and value:
            value = {str(k): v for k, v in value.items()}
        out[name] = value
    return out


def _rendered(
    state: ServerState, seq: SequenceRequest, prefix: str, model: str | None, req: Any
) -> dict[str, Any]:
    return {
        "request_id": f"{prefix}-{uuid.uuid4().hex}",
        "token_ids": list(seq.prompt_token_ids),
        "features": None,
        # The engine runs one sequence per choice: the request's n is what generate takes back.
        "sampling_params": {**rendered_params(seq.params), "n": req.n},
        "model": model,
        "stream": bool(req.stream),
        "stream_options": req.stream_options.model_dump() if req.stream and req.stream_options else None,
        "cache_salt": req.cache_salt,
        "priority": req.priority,
        "kv_transfer_params": None,
    }


async def render_chat(state: ServerState, req: ChatCompletionRequest) -> dict[str, Any]:
    """A chat request's engine input, planned as ``create_chat_completion`` plans it."""
    apply_request_defaults(req, state.config.http)
    await state.resolve_model(req.model)
    lora = state.check_model(req.model)
    if req.use_beam_search:
        raise bad_request("Beam search is not supported by the render endpoint", param="use_beam_search")
    if check_images(state, req.messages):
        raise bad_request("image inputs are not supported by the render endpoint", param="messages")
    tools = plan_tools(req, state.tool_parser)
    planned = req.model_copy(update={"return_prompt_text": True}) if req.return_token_offsets else req
    seqs = await plan_off_loop(prompt_chars(req.messages), plan_chat, state, planned, tools, lora, [])
    out = _rendered(state, seqs[0], "chatcmpl", req.model, req)
    if req.return_token_offsets:  # in the text the template rendered
        out["token_offsets"] = token_offsets(
            state.tokenizer, seqs[0].prompt_text, req.add_special_tokens, out["token_ids"], _keeps_first(req)
        )
    return out


async def render_completion(state: ServerState, req: CompletionRequest) -> list[dict[str, Any]]:
    """A completion request's engine inputs (one per prompt), planned as ``create_completion``
    plans them."""
    apply_request_defaults(req, state.config.http)
    if req.prompt_embeds is not None:
        raise bad_request("prompt_embeds are not supported by the render endpoint", param="prompt_embeds")
    if req.use_beam_search:
        raise bad_request("Beam search is not supported by the render endpoint", param="use_beam_search")
    await state.resolve_model(req.model)
    _, seqs = await plan_off_loop(prompt_chars(req.prompt), plan_completion, state, req, [])
    out = [_rendered(state, seq, "cmpl", req.model, req) for seq in seqs[:: req.n]]
    if req.return_token_offsets:
        raw = req.prompt
        if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
            raw = [raw]
        for rendered, text in zip(out, raw, strict=True):
            source = text if isinstance(text, str) else None  # token ids: no text to point into
            rendered["token_offsets"] = token_offsets(
                state.tokenizer, source, req.add_special_tokens, rendered["token_ids"], _keeps_first(req)
            )
    return out


def _keeps_first(req: Any) -> bool:
    return req.truncation_side == "right"
