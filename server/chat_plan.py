"""A chat request's sequences: its prompt rendered through the chat template (with its images'
placeholder runs), its sampling parameters, token budget, KV transfer and tool or structured-outputs
constraint, one ``SequenceRequest`` per choice (only the resumed ones for a resumed request).

Split from ``server/serving_chat.py``: this is the part that runs off the event loop
(``plan_off_loop``) and only reads the request; answering it (whole or streamed) is there and in
``server/chat_stream.py``. Every error here is the client's: a 4xx before anything is admitted.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.sampling_params import SamplingParams
from server.chat_protocol import ChatCompletionRequest
from server.errors import bad_request
from server.handoff_params import client_budget, kv_transfer_spec, longest_resumed, resumed_choices
from server.images import with_image_runs
from server.params import (
    beam_search_params,
    check_min_tokens,
    check_stream_prompt_logprobs,
    child_seed,
    resolve_max_tokens,
    sampling_params,
)
from server.prompts import rendered_chat_prompt
from server.reasoning_parsers import thinking_budget
from server.roles import producer_budget, transfer_for_role
from server.sequence_request import SequenceRequest, block_extra
from server.serving_common import constraint_field
from server.state import ServerState
from server.tools import ToolPlan


def plan_chat(
    state: ServerState, req: ChatCompletionRequest, tools: ToolPlan | None, lora: Any, images: list[Any]
) -> list[SequenceRequest]:
    limits = state.limits
    rendered = rendered_chat_prompt(
        req, state.tokenizer, state.config.trust_request_chat_template, state.config.chat, limits
    )
    # An image's placeholder expands to its run of image tokens here: the ids are the engine's prompt
    # (what ``prompt_token_ids`` shows), the text keeps the template's one placeholder per image.
    prompt_ids = with_image_runs(state, rendered.token_ids, len(images))
    resumed = resumed_choices(req, 1, limits)
    resume = longest_resumed(resumed)
    extra = block_extra(lora, req.cache_salt)
    # An image's pixels are part of its blocks' hashes, known once the engine has processed it: a
    # consumer's listed hashes are then checked there (LLMEngine.add_request), not here.
    kv = transfer_for_role(
        state.config.role,
        kv_transfer_spec(req, 1),
        prompt_ids,
        state.block_size,
        resume,
        extra,
        check_hashes=not images,
    )
    top_n = req.top_logprobs or 0
    budget = client_budget(req)  # a producer's: the client's (it computes one token whatever it says)
    max_tokens = resolve_max_tokens(
        budget, len(prompt_ids), limits, default=None, num_resumed=len(resume or [])
    )
    if budget is not req:
        check_min_tokens(budget, max_tokens)
    max_tokens = producer_budget(kv, max_tokens)
    check_stream_prompt_logprobs(req)
    base = sampling_params(
        req,
        max_tokens=max_tokens,
        logprobs=top_n if req.logprobs else None,
        limits=limits,
        prompt_logprobs=None if req.stream else req.prompt_logprobs,
        tokenizer=state.tokenizer,
    )
    if tools is not None and tools.constraint is not None:
        if base.structured_outputs is not None:
            raise bad_request(
                f"tool_choice {tools.mode!r} constrains the output itself: it cannot be combined with "
                f"{constraint_field(req)}",
                param="tool_choice",
            )
        base = dataclasses.replace(base, structured_outputs=tools.constraint)
    if base.structured_outputs is not None and state.reasoning is not None:
        base = _after_thinking(state, base, prompt_ids)
    if req.thinking_token_budget is not None:
        thinking = thinking_budget(state.reasoning, state.config.reasoning_parser, req.thinking_token_budget)
        base = dataclasses.replace(base, thinking_token_budget=thinking)
    if (tools is not None and tools.mode == "auto" and tools.parser.needs_special_tokens) or (
        state.reasoning is not None and state.reasoning.needs_special_tokens
    ):
        base = dataclasses.replace(base, skip_special_tokens=False)  # the markers are special tokens
    if req.use_beam_search and state.config.role == "prefill":
        raise bad_request("a prefill worker does not run beam search", param="use_beam_search")
    beam = beam_search_params(req, base, limits, top_n if req.logprobs else None)
    return [
        SequenceRequest(
            j,
            0,
            prompt_ids,
            dataclasses.replace(base, seed=child_seed(req.seed, j)) if j else base,
            (resumed or {}).get(j) or None,
            kv,
            lora=lora,
            priority=req.priority,
            cache_salt=req.cache_salt,
            beam=beam,
            images=images or None,
            n=req.n,
            prompt_text=rendered.text if req.return_prompt_text else None,
        )
        for j in (range(req.n) if resumed is None else resumed)
    ]


def _after_thinking(state: ServerState, params: SamplingParams, prompt_ids: list[int]) -> SamplingParams:
    """With a reasoning parser, a constraint starts once the model has finished thinking (its
    ``</think>`` token), unless the prompt already closed the thinking (Qwen3 with thinking off).
    Where ``</think>`` is not one token the constraint starts at once (``chat_choice.splitter``)."""
    end = state.reasoning_end_id
    if end is None or end in prompt_ids[-8:]:
        return params
    spec = dataclasses.replace(params.structured_outputs, after_token_id=end)
    return dataclasses.replace(params, structured_outputs=spec)
