"""POST /v1/responses: OpenAI's Responses API over the chat endpoint's machinery.

A request is translated into a chat request (``input`` items to messages, ``instructions`` to a
system message, flat function tools to chat tools, ``text.format`` to ``response_format``,
``max_output_tokens`` to ``max_completion_tokens``: ``server/responses_to_chat.py``; the request
body is ``server/responses_protocol.py``'s), served by ``serving_chat`` (so templates, structured
outputs, tool calls, reasoning, admission, aborts and metrics are the same), and its answer turned
into Responses output items: ``reasoning``, ``message`` (``output_text``) and ``function_call``, in
the Responses object ``server/responses_object.py`` builds. The chat request always streams: its
chunk models (``ChatChunks``: never framed as chat SSE) become Responses events
(``server/responses_stream.py``, which also serves a router's internal ``resume`` and
``return_token_ids``), or for a non-streamed request the output of one body, written by the same
code (``collect``): both give the same output items.

A reasoning parser's thought is a ``reasoning`` item: its ``content`` (``reasoning_text``, as vLLM
writes it), or with ``reasoning.summary`` its ``summary`` (the thought itself: no summarizer runs
here), streamed with OpenAI's summary events; vLLM's ``include_reasoning: false`` leaves the item
out and ``thinking_token_budget`` caps the thought as on chat. ``usage.output_tokens_details
.reasoning_tokens`` counts the thought's tokens from the answer's token ids (``server/reasoning_tokens.py``).

``include: ["message.output_text.logprobs"]`` (with ``top_logprobs``) puts chat's token logprobs
on the ``output_text`` parts and text delta events: those of the part's (the delta's) own text, whose
tokens' strings join to it; a tool call's markup, the reasoning and the ending token (EOS) have none
(``server/text_logprobs.py``).

The response is named ``resp_`` and the request's ``X-Request-Id``, or what vLLM's body field
``request_id`` says (``server/middleware.response_id_for``; the router's affinity derives it alike).
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

from collections.abc import Callable
from typing import Any

from starlette.responses import JSONResponse, Response

from server.chat_stream import ChatChunks
from server.errors import APIError, bad_request
from server.middleware import response_id_for
from server.reasoning_tokens import reasoning_counter
from server.responses_input import input_items, without_oldest_turns
from server.responses_object import _Response
from server.responses_protocol import ResponsesRequest, wants_logprobs
from server.responses_records import Saver, load_record, refuse_a_taken_id
from server.responses_refs import resolve_references
from server.responses_store import RUNNING
from server.responses_stream import collect, events
from server.responses_to_chat import CHAT_TO_RESPONSES, to_chat_request
from server.serving_chat import create_chat_completion
from server.serving_messages import renamed
from server.state import ServerState
from server.streaming import SSEResponse, run_or_disconnect


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
        state.background.admit(response_id_for(request_id, req.request_id), req.store)
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
        await refuse_a_taken_id(state, response_id_for(request_id, req.request_id), context + own)
    try:
        answer = await _chat_answer(state, req, context, own, request_id, receive, submitted)
    except APIError as e:
        raise renamed(e, CHAT_TO_RESPONSES) from None
    model = state.answer_model(state.check_model(req.model))  # the chat request checked it: no 404 here
    built = _Response(
        req,
        model,
        request_id,
        store=req.store is not False and state.responses is not None,
        defaults=state.limits.generation_defaults,
    )
    built.count_reasoning = reasoning_counter(state, answer.thinking_open)
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
