"""vLLM's tokens-in, tokens-out ``POST /inference/v1/generate`` (registered by ``server/token_routes.py``).

The body (``token_ids`` and ``sampling_params``, the shape the render routes answer) is read as the
completion request of those ids (``completion_of``), planned and validated as one
(``plan_completion``), and run through ``Generation`` (admission, timeouts, abort on disconnect,
metrics); the answer carries the generated token ids, their logprobs as ``token_id:N`` entries, the
finish reason and usage, whole or streamed (SSE, ``[DONE]``-terminated). ferry's ``resume`` goes on
after tokens another replica already streamed, so a router resumes a generate stream exactly.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import Field, StrictBool, StrictInt, StrictStr, ValidationError

from engine.outputs import PositionLogprobs, RequestOutput
from server.admission_ticket import Ticket
from server.completion_protocol import CompletionRequest
from server.errors import bad_request, validation_error
from server.logprobs import prompt_logprobs_out
from server.params import check_token_ids, resolve_max_tokens
from server.protocol import INT64_MAX, INT64_MIN, SamplingResume, StreamOptions, _Request
from server.sequence_request import SequenceRequest
from server.serving_common import (
    UsageTracker,
    compile_constraints,
    plan_off_loop,
    refused_before_start,
    stream_errors,
)
from server.serving_completions import plan_completion
from server.state import ServerState
from server.streaming import DONE_FRAME, FinalFrames, SSEResponse, run_or_disconnect, sse_frame
from server.vllm_flags import log_request

logger = logging.getLogger("ferry.server")

# vLLM's SamplingParams fields that a completion request takes under the same name.
SAMPLING_FIELDS = frozenset(
    {
        "n",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "seed",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "max_tokens",
        "min_tokens",
        "logprobs",
        "prompt_logprobs",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "include_stop_str_in_output",
        "logit_bias",
        "allowed_token_ids",
        "logprob_token_ids",
        "bad_words",
        "structured_outputs",
        "thinking_token_budget",
        "repetition_detection",
        "stream_interval",
    }
)
# vLLM's that change nothing here (how its engine hands outputs over, or nothing ferry runs).
_IGNORED_FIELDS = frozenset(
    {"detokenize", "output_kind", "flat_logprobs", "extra_args", "skip_reading_prefix_cache", "logprobs_mode"}
)


class GenerateRequest(_Request):
    """vLLM's ``GenerateRequest`` (what render answers and ``/inference/v1/generate`` takes)."""

    request_id: StrictStr | None = None
    token_ids: list[StrictInt] = Field(min_length=1)
    sampling_params: dict[str, Any]
    model: StrictStr | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    cache_salt: StrictStr | None = Field(default=None, min_length=1, max_length=4096)
    priority: StrictInt = Field(default=0, ge=INT64_MIN, le=INT64_MAX)
    features: Any = None  # multimodal features: not taken (400 when given)
    kv_transfer_params: dict[str, Any] | None = None
    # ferry's, as on completions (router -> replica): go on after the tokens a stream already sent
    # from a replica that died, so a router resumes a generate stream exactly.
    resume: SamplingResume | None = None


def completion_of(state: ServerState, body: GenerateRequest) -> CompletionRequest:
    """The completion request of a generate body's token ids and sampling parameters (400s for
    what neither takes)."""
    if body.features is not None:
        raise bad_request("multimodal features are not supported", param="features")
    if body.kv_transfer_params:
        raise bad_request(
            "kv_transfer_params are not supported; see ferry's PD hand-off", param="kv_transfer_params"
        )
    check_token_ids(body.token_ids, state.limits, "token_ids")
    fields: dict[str, Any] = {}
    for name, value in body.sampling_params.items():
        if name in _IGNORED_FIELDS or value is None:
            continue
        if name not in SAMPLING_FIELDS:
            raise bad_request(f"sampling_params.{name} is not supported", param=f"sampling_params.{name}")
        fields[name] = value
    max_tokens = fields.get("max_tokens")
    if max_tokens == 0 and not isinstance(max_tokens, bool):  # completions' 0 scores an echo: none here
        raise bad_request("sampling_params.max_tokens must be at least 1", param="sampling_params.max_tokens")
    if isinstance(fields.get("logit_bias"), dict):
        fields["logit_bias"] = {str(k): v for k, v in fields["logit_bias"].items()}
    data: dict[str, Any] = {
        **fields,
        "prompt": body.token_ids,
        "model": body.model,
        "stream": body.stream,
        "priority": body.priority,
    }
    if body.stream_options is not None:
        data["stream_options"] = body.stream_options.model_dump()
    if body.cache_salt is not None:
        data["cache_salt"] = body.cache_salt
    if body.resume is not None:
        data["resume"] = body.resume.model_dump(exclude_none=True)
    if "max_tokens" not in fields:
        # vLLM's: no budget asked for, the rest of the context (or the generation config's cap).
        # (A request built with max_tokens=None would read as the completions default, 16: a null
        # is taken as unset there.)
        unset = CompletionRequest(prompt=body.token_ids).model_copy(update={"max_tokens": None})
        data["max_tokens"] = resolve_max_tokens(unset, len(body.token_ids), state.limits, None)
    try:
        return CompletionRequest.model_validate(data)
    except ValidationError as e:
        errors = [{**err, "loc": ("sampling_params", *err["loc"])} for err in e.errors()]
        raise validation_error(errors) from e


def _token_logprobs(
    ids: list[int], positions: list[PositionLogprobs] | None, top_n: int, named: bool = False
) -> list[dict]:
    """vLLM's ``ChatCompletionLogProbs.content`` entries, tokens named ``token_id:N``; ``named``: the
    request's ``logprob_token_ids`` are all shown, after the sampled token, in their order."""
    content = []
    for i, tid in enumerate(ids):
        position = positions[i] if positions and i < len(positions) else None
        entry: dict[str, Any] = {
            "token": f"token_id:{tid}",
            "logprob": -9999.0,
            "bytes": None,
            "top_logprobs": [],
        }
        if position is not None and tid in position:
            entry["logprob"] = max(position[tid].logprob, -9999.0)
            ranked = (
                list(position.items())
                if named
                else sorted(position.items(), key=lambda kv: kv[1].rank or 0)[: max(top_n, 1)]
            )
            entry["top_logprobs"] = [
                {"token": f"token_id:{k}", "logprob": max(lp.logprob, -9999.0), "bytes": None}
                for k, lp in ranked
            ]
        content.append(entry)
    return content


def _choice(req: CompletionRequest, index: int, ids: list[int], positions: Any, finish: str | None) -> dict:
    logprobs = (
        {"content": _token_logprobs(ids, positions, req.logprobs, bool(req.logprob_token_ids))}
        if req.logprobs is not None
        else None
    )
    return {"index": index, "logprobs": logprobs, "finish_reason": finish, "token_ids": ids}


async def generate(
    state: ServerState,
    body: GenerateRequest,
    request_id: str,
    receive: Any,
    submitted: Any = None,
    named: str | None = None,
) -> Any:
    """``request_id``: the engine's (the replica's X-Request-Id); ``named``: what the answer is
    named after (``generate-tokens-`` and it, as vLLM names it; ``request_id`` when None)."""
    arrival = time.perf_counter()
    req = completion_of(state, body)
    await state.resolve_model(req.model)
    _, seqs = await plan_off_loop(0, plan_completion, state, req, [])
    # A constraint that does not compile is a 400, streamed or not (not an error event in a 200).
    await compile_constraints(state, seqs, "sampling_params.structured_outputs")
    ticket = state.generation.admit(len(seqs), submitted)
    state.metrics.observe_params(req.n, seqs[0].params.max_tokens)
    response_id = f"generate-tokens-{named or request_id}"
    model = state.answer_model(seqs[0].lora)
    log_request(logger, state.config.http, request_id, model, body.token_ids, seqs[0].params)
    usage = UsageTracker(1, req.n)
    if req.stream:
        frames = _stream(state, req, seqs, usage, response_id, model, request_id, arrival, ticket)
        return SSEResponse(frames, on_close=ticket.close, hold_start=True)

    ids: list[list[int]] = [[] for _ in range(req.n)]
    positions: list[list[PositionLogprobs]] = [[] for _ in range(req.n)]
    finish: list[str | None] = [None] * req.n
    prompt_entries: list[Any] = []

    async def collect() -> dict[str, Any]:
        async for seq, out in state.generation.merged(request_id, seqs, arrival, ticket):
            _add(seq, out, ids, positions, finish)
            usage.add(seq, out)
            if out.finished and out.prompt_logprobs:
                prompt_entries[:] = out.prompt_logprobs
        prompt_logprobs = None
        if req.prompt_logprobs is not None:
            prompt_logprobs = prompt_logprobs_out(
                state.tokenizer, seqs[0].prompt_token_ids, prompt_entries, req.prompt_logprobs
            )
        return {
            "id": response_id,
            "request_id": response_id,
            "created": int(time.time()),
            "model": model,
            "choices": [_choice(req, i, ids[i], positions[i], finish[i] or "stop") for i in range(req.n)],
            "usage": usage.info().model_dump(),
            "prompt_logprobs": [
                None if p is None else {str(k): v.model_dump() for k, v in p.items()} for p in prompt_logprobs
            ]
            if prompt_logprobs is not None
            else None,
            "kv_transfer_params": None,
        }

    try:
        result = await run_or_disconnect(receive, collect())
    finally:
        ticket.close()
    return JSONResponse(result)


def _add(
    seq: SequenceRequest,
    out: RequestOutput,
    ids: list[list[int]],
    positions: list[list[PositionLogprobs]],
    finish: list[str | None],
) -> None:
    o = out.outputs[0]
    ids[seq.choice_index] += o.token_ids
    if o.logprobs is not None:
        positions[seq.choice_index] += o.logprobs
    if out.finished:
        finish[seq.choice_index] = o.finish_reason


async def _stream(
    state: ServerState,
    req: CompletionRequest,
    seqs: list[SequenceRequest],
    usage: UsageTracker,
    response_id: str,
    model: str,
    request_id: str,
    arrival: float,
    ticket: Ticket,
) -> AsyncIterator[bytes]:
    """vLLM's stream: a chunk per output that adds tokens (the finish reason on a choice's last),
    the usage chunk when asked, then ``[DONE]``."""
    produced = False
    tail = b""
    continuous = req.continuous_usage
    async with stream_errors() as failed:
        async for seq, out in state.generation.merged(request_id, seqs, arrival, ticket):
            produced = True
            usage.add(seq, out)
            o = out.outputs[0]
            if not o.token_ids and not out.finished:
                continue
            chunk: dict[str, Any] = {
                "request_id": response_id,
                "choices": [
                    _choice(
                        req,
                        seq.choice_index,
                        list(o.token_ids),
                        o.logprobs,
                        o.finish_reason if out.finished else None,
                    )
                ],
            }
            if continuous:
                chunk["usage"] = usage.info().model_dump()
            yield sse_frame(_json(chunk))
        if req.include_usage:
            tail = sse_frame(
                _json({"request_id": response_id, "choices": [], "usage": usage.info().model_dump()})
            )
    refused_before_start(failed, produced)
    yield FinalFrames(tail + (failed.frame or b"") + DONE_FRAME)


def _json(data: dict[str, Any]) -> str:
    return json.dumps(data, separators=(",", ":"))
