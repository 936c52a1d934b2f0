"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) over chat.

A messages request becomes a chat completions request (``to_chat_request``): ``system`` the first
message, ``tool_use`` blocks an assistant turn's ``tool_calls``, ``tool_result`` blocks ``tool``
messages, ``tools`` and ``tool_choice`` OpenAI's (``any`` is ``required``), ``stop_sequences`` the
stop strings. Its answer comes back as a message: a ``thinking`` block (with a reasoning parser),
then ``text`` blocks and a ``tool_use`` block per call in the order the model wrote them;
``stop_reason`` ``end_turn``, ``max_tokens``, ``stop_sequence`` (naming it) or ``tool_use``. The chat
request always streams: its chunks become Anthropic's events (``server/messages_events.py``:
``message_start``, ``content_block_start`` / ``_delta`` / ``_stop`` per block, ``message_delta`` with
the stop reason and usage, ``message_stop``), each framed as ``event: TYPE`` + ``data: JSON``, or for
a non-streamed request read back into one message, so both give the same blocks.

``usage`` follows Anthropic's accounting: ``input_tokens`` are the prompt tokens not read from the
prefix cache, ``cache_read_input_tokens`` the ones that were. Errors have Anthropic's shape and
name the request's own fields (``stop_sequences``, not the chat request's ``stop``: ``renamed``).
Admission, timeouts, aborts on disconnect and metrics are the chat endpoint's; a request past
``--request-timeout`` is Anthropic's 504 ``timeout_error`` (ferry's 408 elsewhere).
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Callable, Mapping
from functools import partial
from typing import Any

from fastapi.responses import JSONResponse

from server.anthropic_protocol import (
    REQUEST_TIMEOUT,
    CountTokensRequest,
    MessagesRequest,
    error_body,
    error_response,
)
from server.chat_protocol import ChatCompletionChunk, ChatCompletionRequest
from server.chat_stream import ChatChunks
from server.errors import APIError, validated
from server.images import load_images, with_image_runs
from server.messages_events import Event, MessageWriter, whole_message
from server.prompts import chat_prompt
from server.protocol import StreamOptions
from server.serving_chat import create_chat_completion
from server.serving_common import plan_off_loop, prompt_chars, refused_before_start, stream_errors
from server.state import ServerState
from server.streaming import KeepAlive, SSEResponse, run_or_disconnect
from server.tools import AUTO_ALTERNATIVES

# The internal event that carries one chat chunk's events and token ids to a router.
GROUP_EVENT = "ferry_chunk"
# Anthropic's keep-alive event: sent right after message_start, as Anthropic's streams send one,
# and whenever a stream has sent nothing for PING_INTERVAL_S (waiting in the queue, a long
# prefill), so that no proxy's or client's idle timeout cuts it. Its SDKs skip it wherever it comes.
PING_FRAME = b'event: ping\ndata: {"type": "ping"}\n\n'
PING_INTERVAL_S = 10.0
# The chat fields a messages request's fields become, where the names differ.
_CHAT_TO_MESSAGES = {"stop": "stop_sequences"}
# The chat path's advice in the Messages API's words (its tool_choice values, not OpenAI's).
_CHAT_ADVICE = {
    AUTO_ALTERNATIVES: 'send tool_choice {"type": "any"}, {"type": "none"} or {"type": "tool", "name": ...} instead'
}


def to_chat_request(req: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    return validated(ChatCompletionRequest, req.chat_body())


def thinking_budget_tokens(state: ServerState, req: MessagesRequest) -> int | None:
    """``thinking: {"type": "enabled", "budget_tokens": N}`` as the chat request's
    ``thinking_token_budget`` (the engine ends the thinking after N tokens), where this server's
    reasoning parser has ``<think>`` markers to count; elsewhere the field stays what it was before,
    a request the template answers as it does (Anthropic's clients send it unasked)."""
    thinking = req.thinking or {}
    budget = thinking.get("budget_tokens")
    if thinking.get("type") != "enabled" or isinstance(budget, bool) or not isinstance(budget, int):
        return None
    if budget < 0 or state.reasoning is None or not state.reasoning.think_markers:
        return None
    return budget


def renamed(error: APIError, names: Mapping[str, str], keep_parts: bool = False) -> APIError:
    """``error`` naming the fields the client sent instead of the chat fields they became: its
    ``param`` (the field, or a part of it: with ``keep_parts`` the rest of the path is kept, else
    the client's field alone is named), that name quoted in the message, and the chat field names
    with an underscore anywhere in the message (never a word of prose)."""
    param, message = error.param, error.message
    for chat, client in names.items():
        if param is not None and (param == chat or param.startswith(chat + ".")):
            new = client + param[len(chat) :] if keep_parts else client
            param, message = new, message.replace(f"'{error.param}'", f"'{new}'")
            break
    words = "|".join(re.escape(name) for name in names if "_" in name)
    if words:
        message = re.sub(rf"(?<![\w./#])({words})(?!\w)", lambda m: names[m.group(1)], message)
    if param == error.param and message == error.message:
        return error
    return APIError(error.status, message, code=error.code, param=param, headers=error.headers)


def _in_messages_words(error: APIError) -> APIError:
    error = renamed(error, _CHAT_TO_MESSAGES, keep_parts=True)
    for chat, ours in _CHAT_ADVICE.items():
        if chat in error.message:
            message = error.message.replace(chat, ours)
            return APIError(error.status, message, code=error.code, param=error.param, headers=error.headers)
    return error


async def create_message(
    state: ServerState, req: MessagesRequest, request_id: str, receive, submitted: Callable[[], None] | None
) -> Any:
    try:
        chat = to_chat_request(req)
        chat.thinking_token_budget = thinking_budget_tokens(state, req)
        if not req.stream:
            # A whole answer is read from the chat stream's chunks by the writer of the streamed
            # events (``whole_message``): its blocks are the stream's, in the order written.
            chat.stream = True
            chat.stream_options = StreamOptions(include_usage=True)
        answer = await create_chat_completion(state, chat, request_id, receive, submitted, as_chunks=True)
    except APIError as e:
        raise _in_messages_words(e) from None
    assert isinstance(answer, ChatChunks)  # the chat request streams
    writer = MessageWriter(req, f"msg_{request_id}", state.answer_model(state.check_model(req.model)))
    if req.stream:
        # Held like the chat stream it relays: the engine process's admission refusal, its first
        # message, is then a 429 in Anthropic's shape, not a 200 carrying an error event.
        frames = _events(writer, answer)
        refusal = partial(error_response, request_id=request_id)
        keepalive = KeepAlive(PING_INTERVAL_S, PING_FRAME, _error_frame)
        return SSEResponse(
            frames, on_close=answer.on_close, hold_start=True, error_response=refusal, keepalive=keepalive
        )
    try:
        events = await run_or_disconnect(receive, _collect(writer, answer.chunks))
    finally:
        answer.on_close()
    return JSONResponse(whole_message(events, writer.usage))


async def _collect(writer: MessageWriter, chunks: AsyncIterator[ChatCompletionChunk]) -> list[Event]:
    """Every event of a whole answer. An error raises; closing the chunks at the end, or when
    cancelled, aborts the request in the engine."""
    events: list[Event] = []
    try:
        async for chunk in chunks:
            fed = writer.feed(chunk)
            if fed is not None:
                events += fed[1] if writer.started else [writer.opening(), *fed[1]]  # as the stream's
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]
    return events + writer.finish()


async def count_tokens(state: ServerState, req: CountTokensRequest) -> JSONResponse:
    """The prompt's tokens, image runs included. Its images are read as ``/v1/messages`` reads them,
    so an image that request would refuse (data that is not an image, a URL that cannot be read)
    is the same 400 here, never a count."""
    await state.resolve_model(req.model)  # a LoRA adapter of --lora-resolver-dir, loaded on first use
    state.check_model(req.model)
    try:
        chat = to_chat_request(req)
        num_images = len(await load_images(state, chat.messages))
        count = await plan_off_loop(prompt_chars(req), _prompt_length, state, chat, num_images)
    except APIError as e:
        raise renamed(e, _CHAT_TO_MESSAGES, keep_parts=True) from None
    return JSONResponse({"input_tokens": count})


def _prompt_length(state: ServerState, chat: ChatCompletionRequest, num_images: int) -> int:
    config = state.config
    prompt = chat_prompt(chat, state.tokenizer, config.trust_request_chat_template, config.chat, state.limits)
    return len(with_image_runs(state, prompt, num_images))


def _frame(kind: str, payload: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, ensure_ascii=False)}\n\n".encode()


def _error_frame(error: APIError) -> bytes:
    return _frame("error", {"error": error_body(error)["error"]})


async def _events(writer: MessageWriter, answer: ChatChunks) -> AsyncIterator[bytes]:
    """The chat stream's chunks as Anthropic's events. Closing this closes the chat stream (its
    cleanup aborts the request in the engine)."""
    chunks = answer.chunks
    try:
        async for frame in _translate(writer, chunks):
            yield frame
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]


async def _translate(
    writer: MessageWriter, chunks: AsyncIterator[ChatCompletionChunk]
) -> AsyncIterator[bytes]:
    """Anthropic's events of a chat stream, framed. With ``return_token_ids`` (a router that may
    resume the stream) each chunk's content events travel inside one ``GROUP_EVENT`` with the
    chunk's token ids, which the router unpacks (``router/messages_stream.py``)."""
    produced = False
    async with stream_errors() as failed:
        async for chunk in chunks:
            produced = True
            fed = writer.feed(chunk)
            if fed is None:
                continue
            ids, out = fed
            if not writer.started:
                yield _frame(*writer.opening()) + PING_FRAME  # one write, as Anthropic sends them
            if writer.req.return_token_ids:  # one event: a router relays all of it or none of it
                if out or ids:
                    group = [{"type": kind, **payload} for kind, payload in out]
                    yield _frame(GROUP_EVENT, {"token_ids": list(ids or ()), "events": group})
                continue
            for kind, payload in out:
                yield _frame(kind, payload)
    refused_before_start(failed, produced)
    if failed.error is not None and failed.error.status == REQUEST_TIMEOUT and not writer.started:
        # Timed out before message_start (waiting in the queue, a long prefill): the response is
        # Anthropic's 504 ``timeout_error`` itself, not a 200 with an error event (an event when
        # a keep-alive ping has sent the status line).
        raise failed.error
    if failed.error is not None:
        yield _error_frame(failed.error)
        return
    for kind, payload in writer.finish():  # message_start too, when no chunk opened the message
        yield _frame(kind, payload) + (PING_FRAME if kind == "message_start" else b"")
