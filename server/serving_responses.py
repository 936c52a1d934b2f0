"""POST /v1/responses: OpenAI's Responses API over the chat endpoint's machinery.

A request is translated into a chat request (``input`` items to messages, ``instructions`` to a
system message, flat function tools to chat tools, ``text.format`` to ``response_format``,
``max_output_tokens`` to ``max_completion_tokens``), served by ``serving_chat`` (so templates,
structured outputs, tool calls, reasoning, admission, aborts and metrics are the same), and its
answer turned into Responses output items: ``reasoning``, ``message`` (``output_text``) and
``function_call``. The chat request always streams: its chunk models (``ChatChunks``: never framed
as chat SSE) become Responses events (``server/responses_stream.py``, which also serves a router's
internal ``resume`` and ``return_token_ids``), or for a non-streamed request the output of one
body, written by the same code (``collect``): both give the same output items.

``include: ["message.output_text.logprobs"]`` (with ``top_logprobs``) puts chat's token logprobs
on the ``output_text`` parts and text delta events.

A response is stored unless the request says ``store: false`` (or the replica runs with
``--responses-store none``; ``server/responses_records.py`` writes and reads its record): ``previous_response_id`` continues it, an input ``item_reference``
names one of its items (``server/responses_refs.py``), and ``GET`` / ``DELETE
/v1/responses/{id}`` and its ``input_items`` read and drop it (``server/responses_store.py``).
With ``background: true`` (stored responses only) the answer is the queued response (or, with
``stream``, its events as they come) and the generation runs on (``server/responses_background.py``).
Hosted tools (web search, file search, ...) and non-text inputs are a 400, and so are ``conversation``
(there is no Conversations API here) and ``prompt`` (no stored prompts). ``tool_choice``
``allowed_tools`` offers the chat request only the tools it allows (``responses_input``), and
``truncation: auto`` answers a conversation too long for the context without its oldest turns. vLLM's ``structured_outputs`` extra goes to the chat request;
``max_tool_calls`` caps the function calls of the answer: OpenAI counts its built-in tools' calls
across a response and ignores the model's further attempts; this server runs no built-in tools and
answers in one turn, so the cap is on the function calls the model writes, and the generation stops
once it has them (``server/tools.py``): usage counts only the tokens generated, and the stored
response is the one returned.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

from pydantic import Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError
from starlette.responses import JSONResponse, Response

from server.chat_protocol import ChatCompletionRequest
from server.errors import APIError, bad_request, validation_error
from server.middleware import response_id_for
from server.protocol import _Request
from server.responses_input import InputError, chat_messages, chat_tools, input_items, without_oldest_turns
from server.responses_records import Saver, load_record, refuse_a_taken_id
from server.responses_refs import resolve_references
from server.responses_store import RUNNING
from server.responses_stream import collect, events
from server.serving_chat import ChatChunks, create_chat_completion
from server.serving_messages import renamed
from server.state import ServerState
from server.streaming import SSEResponse, run_or_disconnect


class ResponsesResume(_Request):
    """Internal (router -> replica): continue a stream another replica started
    (``server/responses_stream.py``): what the client already has of the response."""

    token_ids: list[StrictInt] = []  # the output tokens sent
    output: list[dict[str, Any]] = []  # the output items, the last ones possibly in progress
    created_at: StrictInt


class ResponsesRequest(_Request):
    model: StrictStr | None = None
    input: StrictStr | list[dict[str, Any]]
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0)
    stream: StrictBool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    text: dict[str, Any] | None = None
    previous_response_id: StrictStr | None = None
    store: StrictBool | None = None
    background: StrictBool = False
    include: list[StrictStr] | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    metadata: dict[str, StrictStr] | None = None
    user: StrictStr | None = None
    # At most this many function calls in the output: the answer stops at the cap (``server/tools.py``).
    max_tool_calls: StrictInt | None = Field(default=None, ge=0)
    # OpenAI's Conversations API object: no conversation store here, so a 400 (``to_chat_request``).
    conversation: Any = None
    # auto: a conversation too long for the context drops its oldest turns (``_chat_answer``).
    truncation: Literal["auto", "disabled"] | None = None
    # A reusable prompt stored at OpenAI (id, version, variables): no prompt store here, so a 400
    # rather than an answer without the prompt's instructions.
    prompt: Any = None
    # vLLM's structured outputs extra, as on the chat endpoint (not with ``text.format``)
    structured_outputs: Any = None
    # vLLM-compatible sampling extras, carried over to the chat request (validated there)
    seed: Any = None
    top_k: Any = None
    min_p: Any = None
    stop: Any = None
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    min_tokens: Any = None
    ignore_eos: Any = None
    priority: Any = None
    cache_salt: Any = None
    # Internal (router -> replica): resume a stream, and group each chunk's events with its token ids
    # so that a router can resume this one (``router/responses_stream.py``).
    resume: ResponsesResume | None = None
    return_token_ids: StrictBool = False


# The chat fields a Responses request's fields become (an error names the client's field).
_CHAT_TO_RESPONSES = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
}

# What ``include`` may name. Only the logprobs are something this server can add; the rest name
# output of hosted tools, images or encrypted reasoning, none of which it ever produces, so
# asking for them adds nothing (clients such as Codex send reasoning.encrypted_content).
LOGPROBS = "message.output_text.logprobs"
INCLUDABLE = frozenset(
    {
        LOGPROBS,
        "file_search_call.results",
        "web_search_call.results",
        "web_search_call.action.sources",
        "message.input_image.image_url",
        "computer_call_output.output.image_url",
        "code_interpreter_call.outputs",
        "reasoning.encrypted_content",
    }
)


def wants_logprobs(req: ResponsesRequest) -> bool:
    return LOGPROBS in (req.include or ())


_EXTRAS = (
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
        **{name: getattr(req, name) for name in _EXTRAS},
        # Every response runs as a chat stream: its chunks make the output items alike whether the
        # client streams or not (responses_stream.collect), and a background response's events
        # are the progress its record follows.
        "stream": True,
        "stream_options": {"include_usage": True},
        "resume": {"token_ids": req.resume.token_ids} if req.resume and req.resume.token_ids else None,
        "return_token_ids": req.return_token_ids,
    }
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        # Name the Responses field the client sent, not the chat field it became.
        errors = [
            {**err, "loc": (_CHAT_TO_RESPONSES.get(err["loc"][0], err["loc"][0]),) if err.get("loc") else ()}
            for err in e.errors(include_url=False)
        ]
        raise validation_error(errors) from None


Status = Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]


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
        self.id = response_id_for(request_id)
        resume = req.resume
        self.created_at = resume.created_at if resume is not None else int(time.time())
        # Output tokens another replica produced (a resumed stream): part of this response's usage.
        self.resumed_tokens = len(resume.token_ids) if resume is not None else 0
        self.model = model
        self.output: list[dict[str, Any]] = []
        self.usage: dict[str, Any] | None = None
        self.background = req.background
        self.status: Status = "queued" if req.background else "in_progress"
        self.error: dict[str, str] | None = None
        self.incomplete: dict[str, str] | None = None
        # How a background response was stopped before its end (status, error), set by
        # BackgroundResponses before it aborts the engine request: the answer then ends as that.
        self.stopped: tuple[Status, dict[str, str] | None] | None = None

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
            "error": self.error,
            "incomplete_details": self.incomplete,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": req.max_tool_calls,
            "model": self.model,
            "output": self.output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": None,
            "store": self.store,
            "temperature": req.temperature
            if req.temperature is not None
            else self.defaults.get("temperature", 1.0),
            "text": req.text or {"format": {"type": "text"}},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [],
            "top_p": req.top_p if req.top_p is not None else self.defaults.get("top_p", 1.0),
            "top_logprobs": req.top_logprobs,
            "truncation": req.truncation or "disabled",
            "usage": self.usage,
            "user": req.user,
            "metadata": req.metadata or {},
        }


async def _chat_answer(
    state: ServerState,
    req: ResponsesRequest,
    context: list[dict[str, Any]],
    own: list[dict[str, Any]],
    request_id: str,
    receive,
    submitted: Callable[[], None] | None,
) -> ChatChunks:
    """The chat stream that answers ``req`` (``context``: the stored conversation it continues).
    With ``truncation: auto`` a conversation too long for the context is answered without its
    oldest turns, as few dropped as fit (each shorter one is tried in turn, so only a conversation
    that does not fit costs more than one rendering); the stored conversation stays whole."""
    items = context + own if context else None
    shorter = without_oldest_turns(context + own) if req.truncation == "auto" else iter(())
    images = state.limits.image is not None
    while True:
        chat = to_chat_request(req, items, images=images)
        try:
            answer = await create_chat_completion(
                state, chat, request_id, receive, submitted, as_chunks=True, max_tool_calls=req.max_tool_calls
            )
        except APIError as e:
            if e.code != "context_length_exceeded" or (items := next(shorter, None)) is None:
                raise
            continue
        assert isinstance(answer, ChatChunks)  # the chat request streams
        return answer


async def create_response(
    state: ServerState,
    req: ResponsesRequest,
    request_id: str,
    receive,
    submitted: Callable[[], None] | None = None,
) -> Response:
    if (req.resume is not None or req.return_token_ids) and (req.background or not req.stream):
        raise bad_request(
            "resume and return_token_ids are for streams (stream: true, without background)",
            param="resume" if req.resume is not None else "return_token_ids",
        )
    if req.background:
        state.background.admit(response_id_for(request_id), req.store)
    context: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        if state.responses is None:
            raise bad_request(
                "previous_response_id needs stored responses, and this server stores none "
                "(--responses-store none): send the whole conversation as input",
                param="previous_response_id",
            )
        record = await load_record(state, req.previous_response_id, param="previous_response_id")
        status = record["response"].get("status")
        if status in RUNNING:
            raise bad_request(
                f"Previous response with id '{req.previous_response_id}' is still {status}: "
                "wait until it completes (or cancel it).",
                param="previous_response_id",
                code="previous_response_in_progress",
            )
        context = record["input"] + record["response"]["output"]
    resolved = await resolve_references(state.responses, req.input)
    if resolved is not req.input:  # item references: the stored items they name from here on
        req = req.model_copy(update={"input": resolved})
    own = input_items(req.input)
    if req.resume is None and req.store is not False and state.responses is not None:
        await refuse_a_taken_id(state, response_id_for(request_id), context + own)
    try:
        answer = await _chat_answer(state, req, context, own, request_id, receive, submitted)
    except APIError as e:
        raise renamed(e, _CHAT_TO_RESPONSES) from None
    model = state.answer_model(state.check_model(req.model))  # the chat request checked it: no 404 here
    built = _Response(
        req,
        model,
        request_id,
        store=req.store is not False and state.responses is not None,
        defaults=state.limits.generation_defaults,
    )
    save = Saver(state, built, context + own)
    if req.stream or req.background:
        frames = events(
            built,
            answer.chunks,
            save,
            want_logprobs=wants_logprobs(req),
            grouped=req.return_token_ids,
            resumed=req.resume.output if req.resume is not None else None,
        )
        if req.background:
            return await state.background.start(built, request_id, frames, save, answer.on_close)
        return SSEResponse(frames, on_close=answer.on_close)
    try:
        await run_or_disconnect(
            receive, collect(built, answer.chunks, save, want_logprobs=wants_logprobs(req))
        )
    finally:
        answer.on_close()
    return JSONResponse(built.body())
