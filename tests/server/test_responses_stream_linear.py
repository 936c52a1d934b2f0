"""A long streamed Responses answer costs time linear in its length: the open message's text and a
function call's arguments are kept as the pieces the chat stream sent and joined once, when the item
is done. Appending each delta to one string copied all the text so far every time: 12 MB of text
and 12 MB of arguments in 2 kB deltas took ~11 s of CPU (quadratic), now ~25 ms.

Timed through ``collect`` (a whole answer), which reads the chat chunks with the ``_Output`` that
``events`` streams with, without framing each delta as an SSE event (~30 us of JSON per delta,
linear, which would hide the difference)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from server.chat_protocol import (
    ChatCompletionChunk,
    ChatStreamChoice,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
)
from server.responses_object import _Response
from server.responses_protocol import ResponsesRequest
from server.responses_stream import collect

PIECES, PIECE = 6000, 2000  # 12 MB of text, then 12 MB of arguments
# CPU seconds: the quadratic code took ~20x this on this input, the linear one ~1/25.
BOUND_S = 0.5


def _chunk(delta: DeltaMessage, finish: str | None = None) -> ChatCompletionChunk:
    choice = ChatStreamChoice(index=0, delta=delta, finish_reason=finish)
    return ChatCompletionChunk(id="c", created=0, model="m", choices=[choice])


async def test_a_long_streamed_text_and_call_take_linear_time() -> None:
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    req = ResponsesRequest.model_validate(
        {"input": "hi", "stream": True, "tools": tools, "tool_choice": {"type": "function", "name": "f"}}
    )
    built = _Response(req, "m", "req-1")
    text, arguments = "t" * (PIECE - 1) + "\n", "a" * (PIECE - 1) + ","
    call = DeltaToolCall(index=0, id="call_1", type="function", function=DeltaFunctionCall(name="f"))
    more = DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=arguments))
    # Built before the clock starts: only the translation is timed.
    chunks = [_chunk(DeltaMessage(content=text)) for _ in range(PIECES)]
    chunks.append(_chunk(DeltaMessage(tool_calls=[call])))
    chunks += [_chunk(DeltaMessage(tool_calls=[more])) for _ in range(PIECES)]
    chunks.append(_chunk(DeltaMessage(), finish="tool_calls"))

    async def answer() -> AsyncIterator[ChatCompletionChunk]:
        for chunk in chunks:
            yield chunk

    async def save() -> None:
        pass

    start = time.process_time()
    await collect(built, answer(), save, want_logprobs=False)
    spent = time.process_time() - start
    done = built.output
    assert [(item["type"], item["status"]) for item in done] == [
        ("message", "completed"),
        ("function_call", "completed"),
    ]
    assert done[0]["content"][0]["text"] == text * PIECES
    assert done[1]["arguments"] == arguments * PIECES and done[1]["call_id"] == "call_1"
    assert spent < BOUND_S, f"{spent:.2f} s of CPU for {2 * PIECES} deltas: not linear"
