"""The Responses object of one request (``_Response``) as it is built: its status, output items and
usage, and its JSON body (what a non-streamed request returns, the events carry, and the store keeps).

Filled by ``server/responses_stream.py`` from the chat chunks, finished by a background run's stop
(``server/responses_background.py``), stored by ``server/responses_records.py``; its own module so
that none of them imports the endpoint (``server/serving_responses.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from server.middleware import response_id_for
from server.responses_protocol import ResponsesRequest

Status = Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]

# The codes OpenAI's response ``error`` may carry (its SDKs type the field as these alone). This
# server's own codes for a failed generation (``request_timeout``, ``internal_error``...) are
# ``server_error`` there, the code kept as the error's ``type``; the stream's ``error`` event, whose
# code is free text, carries it as it is.
_ERROR_CODES = frozenset(
    {
        "server_error",
        "rate_limit_exceeded",
        "invalid_prompt",
        "vector_store_timeout",
        "invalid_image",
        "invalid_image_format",
        "invalid_base64_image",
        "invalid_image_url",
        "image_too_large",
        "image_too_small",
        "image_parse_error",
        "image_content_policy_violation",
        "invalid_image_mode",
        "image_file_too_large",
        "unsupported_image_media_type",
        "empty_image_file",
        "failed_to_download_image",
        "image_file_not_found",
    }
)


def _openai_error(error: dict[str, Any] | None) -> dict[str, Any] | None:
    if error is None or error.get("code") in _ERROR_CODES:
        return error
    return {**error, "code": "server_error", "type": error.get("code")}


class _Response:
    """The Responses object being built (one per request)."""

    def __init__(
        self,
        req: ResponsesRequest,
        model: str,
        request_id: str,
        store: bool = False,
        defaults: Mapping[str, Any] | None = None,
    ) -> None:
        self.req = req
        self.defaults = defaults or {}  # the model's default sampling values (generation_config.json)
        self.store = store  # to be stored once complete (set False if storing failed)
        self.id = response_id_for(request_id, req.request_id)
        resume = req.resume
        self.created_at = resume.created_at if resume is not None else int(time.time())
        # Output tokens another replica produced (a resumed stream): part of this response's usage.
        self.resumed_tokens = len(resume.token_ids) if resume is not None else 0
        self.model = model
        self.output: list[dict[str, Any]] = []
        self.usage: dict[str, Any] | None = None
        self.background = req.background
        self.status: Status = "queued" if req.background else "in_progress"
        self.completed_at: int | None = None  # OpenAI's: set once the response is completed
        self.error: dict[str, str] | None = None
        self.incomplete: dict[str, str] | None = None
        # How a background response was stopped before its end (status, error), set by
        # BackgroundResponses before it aborts the engine request: the answer then ends as that.
        self.stopped: tuple[Status, dict[str, str] | None] | None = None
        # usage.output_tokens_details.reasoning_tokens of the answer's token ids (the resumed ones
        # first): the reasoning parser's count (``server/reasoning_tokens.py``); None: 0.
        self.count_reasoning: Callable[[Sequence[int]], int] | None = None

    @property
    def keeps_events(self) -> bool:
        """Its events are kept for ``GET /v1/responses/{id}?stream=true`` (background + stream)."""
        return self.background and self.req.stream

    def finish(self, finish_reason: str | None) -> None:
        if self.stopped is not None:
            self.status, self.error = self.stopped
        elif finish_reason == "length":
            self.status, self.incomplete = "incomplete", {"reason": "max_output_tokens"}
        else:
            self.status = "completed"
            self.completed_at = int(time.time())

    def set_usage(self, usage: dict[str, Any], reasoning_tokens: int = 0) -> None:
        details = usage.get("prompt_tokens_details") or {}
        self.usage = {
            "input_tokens": usage.get("prompt_tokens", 0),
            # OpenAI's schema requires cache_write_tokens: none are billed as written here (the
            # prefix cache fills as a side effect), as the Messages API's cache_creation_input_tokens.
            "input_tokens_details": {
                "cached_tokens": details.get("cached_tokens", 0),
                "cache_write_tokens": 0,
            },
            "output_tokens": usage.get("completion_tokens", 0) + self.resumed_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": usage.get("total_tokens", 0) + self.resumed_tokens,
        }

    def body(self) -> dict[str, Any]:
        req = self.req
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "background": self.background,
            "completed_at": self.completed_at,
            "error": _openai_error(self.error),
            "incomplete_details": self.incomplete,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": req.max_tool_calls,
            "model": self.model,
            "output": self.output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "prompt_cache_key": req.prompt_cache_key,
            "prompt_cache_retention": req.prompt_cache_retention,
            "reasoning": _reasoning_echo(req),
            "safety_identifier": req.safety_identifier,
            "service_tier": "default",  # the tier that served it, as OpenAI's answers name it
            "store": self.store,
            "temperature": req.temperature
            if req.temperature is not None
            else self.defaults.get("temperature", 1.0),
            "text": {"format": {"type": "text"}, **(req.text or {})},  # a text without format is text
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [],
            "top_p": req.top_p if req.top_p is not None else self.defaults.get("top_p", 1.0),
            "top_logprobs": req.top_logprobs if req.top_logprobs is not None else 0,
            "truncation": req.truncation or "disabled",
            "usage": self.usage,
            "user": req.user,
            "metadata": req.metadata or {},
        }


def _reasoning_echo(req: Any) -> dict[str, Any] | None:
    """The request's ``reasoning``, as given (``effort``, ``summary``); the deprecated
    ``generate_summary`` only when it was sent."""
    if req.reasoning is None:
        return None
    echo = req.reasoning.model_dump()
    if echo.get("generate_summary") is None:
        echo.pop("generate_summary", None)
    return echo
