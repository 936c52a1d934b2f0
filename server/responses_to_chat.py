"""A Responses request as the chat request that answers it (``to_chat_request``): ``input`` items
to messages, ``instructions`` to a system message, flat function tools to chat tools,
``text.format`` to ``response_format``, ``max_output_tokens`` to ``max_completion_tokens``,
``reasoning.effort`` to ``reasoning_effort``, vLLM's ``chat_template_kwargs`` and sampling extras
carried over, a partial assistant message last in the input continued (vLLM's); the fields this
server cannot honour (``conversation``, ``prompt``, an unknown ``include``) are a 400 here.

Split from ``server/serving_responses.py``, which serves the chat request; an error in the chat
request names the client's Responses field (``CHAT_TO_RESPONSES``).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from server.chat_protocol import ChatCompletionRequest
from server.errors import bad_request, validation_error
from server.responses_input import InputError, chat_messages, chat_tools, continues_final_message
from server.responses_protocol import INCLUDABLE, ResponsesRequest, wants_logprobs

# The chat fields a Responses request's fields become (an error names the client's field).
CHAT_TO_RESPONSES = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
}

_EXTRAS = (
    "chat_template_kwargs",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "seed",
    "top_k",
    "min_p",
    "stop",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "priority",
    "cache_salt",
    "structured_outputs",
    "thinking_token_budget",
)


def _response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    fmt = (req.text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_request("text.format.type must be text, json_object or json_schema", param="text.format")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    if fmt.get("schema") is None:
        raise bad_request("text.format of type 'json_schema' needs schema", param="text.format")
    schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
    return {"type": "json_schema", "json_schema": schema}


def to_chat_request(
    req: ResponsesRequest, items: list[dict[str, Any]] | None = None, images: bool = False
) -> ChatCompletionRequest:
    """The chat request ``req`` runs as; ``items``: its whole conversation as input items (the
    responses it continues, then its own input), if not just ``req.input``."""
    if req.conversation is not None:
        raise bad_request(
            "conversation is not supported: this server has no Conversations API; continue a stored "
            "response with previous_response_id instead",
            param="conversation",
        )
    if req.prompt is not None:
        raise bad_request(
            "prompt (a reusable prompt stored at OpenAI) is not supported: this server stores no "
            "prompts; send its text as instructions and input instead",
            param="prompt",
        )
    if (
        req.structured_outputs is not None
        and ((req.text or {}).get("format") or {}).get("type", "text") != "text"
    ):
        raise bad_request(
            "structured_outputs cannot be combined with text.format", param="structured_outputs"
        )
    if (
        req.max_tool_calls == 0
        and req.tools
        and (req.tool_choice == "required" or isinstance(req.tool_choice, dict))
    ):
        raise bad_request(
            "max_tool_calls 0 allows no call, which tool_choice requires", param="max_tool_calls"
        )
    for i, name in enumerate(req.include or ()):
        if name not in INCLUDABLE:
            raise bad_request(f"include[{i}]: unknown value {name!r}", param="include")
    try:
        tools, choice = chat_tools(req.tools, req.tool_choice)
        messages = chat_messages(req.instructions, req.input if items is None else items, images)
    except InputError as e:
        raise bad_request(str(e), param=e.param) from None
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tools": tools,
        "tool_choice": choice,
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _response_format(req),
        "logprobs": wants_logprobs(req) or None,
        "top_logprobs": (req.top_logprobs or 0) if wants_logprobs(req) else None,
        "user": req.user,
        # The template's reasoning_effort, as a chat request's (gpt-oss's template writes it).
        "reasoning_effort": req.reasoning.effort if req.reasoning is not None else None,
        # vLLM's: a partial assistant message last in the input is continued, not answered.
        "add_generation_prompt": not continues_final_message(req.input),
        "continue_final_message": continues_final_message(req.input),
        **{name: getattr(req, name) for name in _EXTRAS},
        # Every response runs as a chat stream: its chunks make the output items alike whether the
        # client streams or not (responses_stream.collect), and a background response's events
        # are the progress its record follows.
        "stream": True,
        "stream_options": {"include_usage": True},
        "resume": {"token_ids": req.resume.token_ids} if req.resume and req.resume.token_ids else None,
        # Always: each chunk's token ids are what ``usage.output_tokens_details.reasoning_tokens``
        # counts (``server/reasoning_tokens.py``); a client sees them only when it asked.
        "return_token_ids": True,
    }
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        # Name the Responses field the client sent, not the chat field it became.
        errors = [
            {**err, "loc": (CHAT_TO_RESPONSES.get(err["loc"][0], err["loc"][0]),) if err.get("loc") else ()}
            for err in e.errors(include_url=False)
        ]
        raise validation_error(errors) from None
