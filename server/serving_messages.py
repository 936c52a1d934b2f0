"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) over chat.

A messages request becomes a chat completions request (``to_chat_request``): ``system`` the first
message, ``tool_use`` blocks an assistant turn's ``tool_calls``, ``tool_result`` blocks ``tool``
messages, ``tools`` and ``tool_choice`` OpenAI's (``any`` is ``required``), ``stop_sequences`` the
stop strings. Its answer comes back as a message: a ``thinking`` block (with a reasoning parser),
a ``text`` block, a ``tool_use`` block per call; ``stop_reason`` ``end_turn``, ``max_tokens``,
``stop_sequence`` (naming it) or ``tool_use``. Streamed, the chat chunks become Anthropic's events
(``message_start``, ``content_block_start`` / ``_delta`` / ``_stop`` per block, ``message_delta``
with the stop reason and usage, ``message_stop``), each as ``event: TYPE`` + ``data: JSON``.

``usage`` follows Anthropic's accounting: ``input_tokens`` are the prompt tokens not read from the
prefix cache, ``cache_read_input_tokens`` the ones that were. Errors have Anthropic's shape and
name the request's own fields (``stop_sequences``, not the chat request's ``stop``: ``renamed``).
Admission, timeouts, aborts on disconnect and metrics are the chat endpoint's.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from fastapi.responses import JSONResponse

from server.anthropic_protocol import CountTokensRequest, MessagesRequest, error_body, error_response
from server.chat_protocol import ChatCompletionChunk, ChatCompletionRequest
from server.chat_stream import ChatChunks
from server.errors import APIError, validated
from server.images import load_images, with_image_runs
from server.prompts import chat_prompt
from server.serving_chat import create_chat_completion
from server.serving_common import plan_off_loop, prompt_chars, refused_before_start, stream_errors
from server.state import ServerState
from server.streaming import SSEResponse

# The internal event that carries one chat chunk's events and token ids to a router.
GROUP_EVENT = "ferry_chunk"
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}
# The chat fields a messages request's fields become, where the names differ.
_CHAT_TO_MESSAGES = {"stop": "stop_sequences"}


def to_chat_request(req: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    return validated(ChatCompletionRequest, req.chat_body())


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


def stop_reason(finish_reason: str | None, stop: Any, req: MessagesRequest) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for a chat choice's end."""
    if finish_reason == "stop" and isinstance(stop, str) and stop in (req.stop_sequences or ()):
        return "stop_sequence", stop
    return _STOP_REASONS.get(finish_reason or "", "end_turn"), None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, int]:
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "output_tokens": completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached_tokens,
    }


def _usage_of(chat_usage: dict[str, Any]) -> dict[str, int]:
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return usage(chat_usage["prompt_tokens"], chat_usage["completion_tokens"], cached)


def _tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


async def create_message(
    state: ServerState, req: MessagesRequest, request_id: str, receive, submitted: Callable[[], None] | None
) -> Any:
    try:
        chat = to_chat_request(req)
        answer = await create_chat_completion(state, chat, request_id, receive, submitted, as_chunks=True)
    except APIError as e:
        raise renamed(e, _CHAT_TO_MESSAGES, keep_parts=True) from None
    message_id = f"msg_{request_id}"
    model = state.answer_model(state.check_model(req.model))
    if isinstance(answer, ChatChunks):
        # Held like the chat stream it relays: the engine process's admission refusal, its first
        # message, is then a 429 in Anthropic's shape, not a 200 carrying an error event.
        frames = _events(req, message_id, model, answer)
        return SSEResponse(frames, on_close=answer.on_close, hold_start=True, error_response=error_response)
    data = json.loads(answer.body)  # type: ignore[attr-defined]
    choice = data["choices"][0]
    message = choice["message"]
    content: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        content.append(
            {"type": "tool_use", "id": call["id"], "name": fn["name"], "input": _tool_input(fn["arguments"])}
        )
    reason, sequence = stop_reason(choice.get("finish_reason"), choice.get("stop_reason"), req)
    if message.get("tool_calls") and reason == "end_turn":  # a named tool_choice's chat says "stop"
        reason = "tool_use"
    return JSONResponse(
        {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": _usage_of(data["usage"]),
        }
    )


async def count_tokens(state: ServerState, req: CountTokensRequest) -> JSONResponse:
    """The prompt's tokens, image runs included. Its images are read as ``/v1/messages`` reads them,
    so an image that request would refuse (data that is not an image, a URL that cannot be read)
    is the same 400 here, never a count."""
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


async def _events(
    req: MessagesRequest, message_id: str, model: str, answer: ChatChunks
) -> AsyncIterator[bytes]:
    """The chat stream's chunks as Anthropic's events. Closing this closes the chat stream (its
    cleanup aborts the request in the engine)."""
    chunks = answer.chunks
    try:
        async for frame in _translate(req, message_id, model, chunks):
            yield frame
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]


async def _translate(
    req: MessagesRequest, message_id: str, model: str, chunks: AsyncIterator[ChatCompletionChunk]
) -> AsyncIterator[bytes]:
    """Anthropic's events of a chat stream. With ``return_token_ids`` (a router that may resume the
    stream) each chunk's content events travel inside one ``GROUP_EVENT`` with the chunk's token
    ids, which the router unpacks (``router/messages_stream.py``)."""
    started = False
    block: str | None = None  # the kind of the open content block: thinking, text or tool_use
    index = -1  # the open block's index
    calls: dict[int, int] = {}  # a chat tool call's index -> its tool_use block's index
    end: tuple[str, str | None] | None = None
    last_usage: dict[str, int] = usage(0, 0, 0)
    Event = tuple[str, dict[str, Any]]

    def start(kind: str, content_block: dict[str, Any]) -> list[Event]:
        nonlocal block, index
        out = close()
        block, index = kind, index + 1
        out.append(("content_block_start", {"index": index, "content_block": content_block}))
        return out

    def close() -> list[Event]:
        nonlocal block
        if block is None:
            return []
        block = None
        return [("content_block_stop", {"index": index})]

    def delta(at: int, payload: dict[str, Any]) -> Event:
        return ("content_block_delta", {"index": at, "delta": payload})

    def opening() -> bytes:
        message = {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {**last_usage, "output_tokens": 0},
        }
        return _frame("message_start", {"message": message})

    produced = False
    async with stream_errors() as failed:
        async for chunk in chunks:
            produced = True
            if chunk.usage is not None:
                last_usage = _usage_of(chunk.usage.model_dump())
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            d = choice.delta
            ids = choice.token_ids if req.return_token_ids else None
            if d.role is not None and not (d.content or d.reasoning_content or d.tool_calls or ids):
                continue  # the role chunk: message_start waits for the prompt's usage
            if not started:
                started = True
                yield opening()
            out: list[Event] = []
            if d.reasoning_content:
                if block != "thinking":
                    out += start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                out.append(delta(index, {"type": "thinking_delta", "thinking": d.reasoning_content}))
            if d.content:
                if block != "text":
                    out += start("text", {"type": "text", "text": ""})
                out.append(delta(index, {"type": "text_delta", "text": d.content}))
            for call in d.tool_calls or []:
                if call.index not in calls:
                    block_start = {"type": "tool_use", "id": call.id, "name": call.function.name, "input": {}}
                    out += start("tool_use", block_start)
                    calls[call.index] = index
                if call.function.arguments:
                    out.append(
                        delta(
                            calls[call.index],
                            {"type": "input_json_delta", "partial_json": call.function.arguments},
                        )
                    )
            if choice.finish_reason is not None:
                end = stop_reason(choice.finish_reason, choice.stop_reason, req)
            if req.return_token_ids:  # one event: a router relays all of it or none of it
                if out or ids:
                    group = [{"type": kind, **payload} for kind, payload in out]
                    yield _frame(GROUP_EVENT, {"token_ids": list(ids or ()), "events": group})
                continue
            for kind, payload in out:
                yield _frame(kind, payload)
    refused_before_start(failed, produced)
    if failed.error is not None:
        yield _frame("error", {"error": error_body(failed.error)["error"]})
        return
    if not started:
        yield opening()
    for kind, payload in close():
        yield _frame(kind, payload)
    reason, sequence = end or ("end_turn", None)
    if calls and reason == "end_turn":  # the turn ends in a call (a named tool_choice's chat says "stop")
        reason = "tool_use"
    yield _frame(
        "message_delta",
        {
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": {"output_tokens": last_usage["output_tokens"]},
        },
    )
    yield _frame("message_stop", {})
