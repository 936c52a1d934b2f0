"""Anthropic's Messages events of a chat stream, and the whole message they describe.

``MessageWriter`` turns the chat stream's chunks (``ChatChunks``) into ``message_start``,
``content_block_start`` / ``_delta`` / ``_stop`` per block, ``message_delta`` (stop reason, usage)
and ``message_stop``: a block per run of thinking, text or a tool call, in the order the model
wrote them (text between two calls is a text block between their ``tool_use`` blocks).
``whole_message`` reads those events back into the message a non-streamed request answers, so a
whole answer's content blocks are the blocks its stream would have sent, in the same order, however
the engine's outputs were batched into chunks. Framing (SSE) is ``server/serving_messages.py``'s.
"""

from __future__ import annotations

import json
from typing import Any

from server.anthropic_protocol import MessagesRequest
from server.chat_protocol import ChatCompletionChunk

Event = tuple[str, dict[str, Any]]  # kind, payload
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def stop_reason(finish_reason: str | None, stop: Any, req: MessagesRequest) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for a chat choice's end. ``stop_sequence``
    names the stop sequence generated, also after a tool call (chat's ``tool_calls``); ``finish``
    then still says ``tool_use``, as clients run the calls on that reason (vLLM's Anthropic endpoint
    reports no ``stop_sequence`` at all)."""
    matched = isinstance(stop, str) and stop in (req.stop_sequences or ())
    if finish_reason in ("stop", "tool_calls") and matched:
        return "stop_sequence", stop
    return _STOP_REASONS.get(finish_reason or "", "end_turn"), None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """A message's ``usage`` as Anthropic's answers carry it: the prompt split into the tokens
    computed (``input_tokens``) and those read from the prefix cache (``cache_read_input_tokens``);
    nothing is ever written to a paid cache here (``cache_creation_input_tokens`` and its
    breakdown by lifetime are 0), and every request is served at the one, standard, tier."""
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached_tokens,
        "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0},
        "output_tokens": completion_tokens,
        "service_tier": "standard",
    }


# The counts a stream's ``message_delta`` repeats, cumulative, as Anthropic's does (its SDKs take
# each one that is there over ``message_start``'s: the SDK's ``MessageDeltaUsage``).
DELTA_USAGE = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens", "output_tokens")


def delta_usage(whole: dict[str, Any]) -> dict[str, int]:
    return {name: whole[name] for name in DELTA_USAGE}


def usage_of(chat_usage: dict[str, Any]) -> dict[str, Any]:
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return usage(chat_usage["prompt_tokens"], chat_usage["completion_tokens"], cached)


def tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class MessageWriter:
    """One answer's events as its chat chunks come (``feed``), then its end (``finish``)."""

    def __init__(self, req: MessagesRequest, message_id: str, model: str) -> None:
        self.req = req
        self.message_id = message_id
        self.model = model
        self.started = False  # message_start sent
        self.block: str | None = None  # the kind of the open content block: thinking, text or tool_use
        self.index = -1  # the open block's index
        self.calls: dict[int, int] = {}  # a chat tool call's index -> its tool_use block's index
        self.end: tuple[str, str | None] | None = None
        self.usage: dict[str, Any] = usage(0, 0, 0)

    def opening(self) -> Event:
        message = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {**self.usage, "output_tokens": 0},
        }
        self.started = True
        return "message_start", {"message": message}

    def _start(self, kind: str, content_block: dict[str, Any]) -> list[Event]:
        out = self._close()
        self.block, self.index = kind, self.index + 1
        out.append(("content_block_start", {"index": self.index, "content_block": content_block}))
        return out

    def _close(self) -> list[Event]:
        if self.block is None:
            return []
        self.block = None
        return [("content_block_stop", {"index": self.index})]

    def feed(self, chunk: ChatCompletionChunk) -> tuple[list[int] | None, list[Event]] | None:
        """(the chunk's token ids when the request returns them, its content events), or None for
        a chunk that says nothing yet (the role chunk: message_start waits for the prompt's usage).
        ``message_start`` is not among the events: see ``started``."""
        if chunk.usage is not None:
            self.usage = usage_of(chunk.usage.model_dump())
        if not chunk.choices:
            return None
        choice = chunk.choices[0]
        d = choice.delta
        ids = choice.token_ids if self.req.return_token_ids else None
        if d.role is not None and not (d.content or d.reasoning_content or d.tool_calls or ids):
            return None
        out: list[Event] = []
        if d.reasoning_content:
            if self.block != "thinking":
                out += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(_delta(self.index, {"type": "thinking_delta", "thinking": d.reasoning_content}))
        if d.content:
            if self.block != "text":
                out += self._start("text", {"type": "text", "text": ""})
            out.append(_delta(self.index, {"type": "text_delta", "text": d.content}))
        for call in d.tool_calls or []:
            if call.index not in self.calls:
                block_start = {"type": "tool_use", "id": call.id, "name": call.function.name, "input": {}}
                out += self._start("tool_use", block_start)
                self.calls[call.index] = self.index
            if call.function.arguments:
                partial = {"type": "input_json_delta", "partial_json": call.function.arguments}
                out.append(_delta(self.calls[call.index], partial))
        if choice.finish_reason is not None:
            self.end = stop_reason(choice.finish_reason, choice.stop_reason, self.req)
        return ids, out

    def finish(self) -> list[Event]:
        """The events that end the message (``message_start`` first if nothing opened it)."""
        out = [] if self.started else [self.opening()]
        out += self._close()
        reason, sequence = self.end or ("end_turn", None)
        if self.calls and reason in ("end_turn", "stop_sequence"):
            # A turn with calls ends in them (a named tool_choice's chat says "stop"); a stop
            # sequence generated after a call is still named in ``stop_sequence``.
            reason = "tool_use"
        out.append(
            (
                "message_delta",
                {
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": delta_usage(self.usage),
                },
            )
        )
        out.append(("message_stop", {}))
        return out


def _delta(at: int, payload: dict[str, Any]) -> Event:
    return "content_block_delta", {"index": at, "delta": payload}


def whole_message(events: list[Event], final_usage: dict[str, Any]) -> dict[str, Any]:
    """The message a whole answer is: its events' blocks, each with its deltas joined, in order."""
    message: dict[str, Any] = {}
    blocks: list[dict[str, Any]] = []
    parts: list[list[str]] = []  # each block's deltas (text, thinking or a tool's partial JSON)
    for kind, payload in events:
        if kind == "message_start":
            message = {**payload["message"]}
        elif kind == "content_block_start":
            blocks.append({**payload["content_block"]})
            parts.append([])
        elif kind == "content_block_delta":
            d = payload["delta"]
            parts[payload["index"]].append(d[_DELTA_FIELDS[d["type"]]])
        elif kind == "message_delta":
            message.update(payload["delta"])
    for block, pieces in zip(blocks, parts, strict=True):
        if block["type"] == "tool_use":
            block["input"] = tool_input("".join(pieces))
        else:
            block[block["type"]] = "".join(pieces)  # a text block's "text", a thinking block's "thinking"
    return {**message, "content": blocks, "usage": final_usage}


# A content block delta's type -> the field that holds its piece.
_DELTA_FIELDS = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}
