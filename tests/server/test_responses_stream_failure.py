"""A Responses stream that fails part way (here: ``--request-timeout`` while the engine is held)
ends as OpenAI's does: an ``error`` event, then ``response.failed``; the output items the failure
cut off are done ``incomplete`` (never ``completed``: their text is not the model's whole answer),
items done before it stay ``completed``, and a background response's stored record says the same.

The replica runs its engine in its own process (``--api-server-count 2``), which the test stops
(SIGSTOP) once the answer's first text has arrived: the API server's request timeout then fires with
a message item open, whatever the machine's speed. A function call cut off the same way is checked
on the translation itself (``events``), fed the chat chunks such a stream is made of.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import openai
import pytest

from server.chat_protocol import (
    ChatCompletionChunk,
    ChatStreamChoice,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
)
from server.errors import timeout_error
from server.responses_object import _Response
from server.responses_protocol import ResponsesRequest
from server.responses_stream import events
from tests.server.test_api_servers import _processes

TIMEOUT_S = 2
LONG = {"ignore_eos": True}


@pytest.fixture(scope="module")
def srv(tiny_llama: Path, serve_logs: Path, server_process) -> Iterator:
    flags = ["--api-server-count", "2", "--request-timeout", str(TIMEOUT_S), "--num-kv-blocks", "256"]
    server = server_process(tiny_llama, flags, serve_logs).start()
    yield server
    server.stop()


def _until_text(stream) -> list:
    """The stream's events up to its first text delta."""
    seen = []
    for event in stream:
        seen.append(event)
        if event.type == "response.output_text.delta":
            return seen
    raise AssertionError(f"the stream ended before any text: {[e.type for e in seen]}")


def test_a_failed_stream_leaves_its_open_item_incomplete(srv) -> None:
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
    engine, _ = _processes(srv)
    create = {"model": srv.model_name, "input": "Tell a story.", "max_output_tokens": 900, "extra_body": LONG}
    foreground = client.responses.create(stream=True, store=True, **create)  # type: ignore[call-overload]
    background = client.responses.create(stream=True, background=True, **create)  # type: ignore[call-overload]
    heads = [_until_text(foreground), _until_text(background)]
    os.kill(engine, signal.SIGSTOP)  # no more tokens: both requests run into the timeout
    try:
        time.sleep(TIMEOUT_S + 0.5)
    finally:
        os.kill(engine, signal.SIGCONT)
    ends = []
    for head, stream in zip(heads, (foreground, background), strict=True):
        seen = head + list(stream)
        kinds = [e.type for e in seen]
        assert kinds[-2:] == ["error", "response.failed"], kinds
        assert "response.completed" not in kinds and "response.incomplete" not in kinds
        error = seen[-2]
        assert (error.code, error.message) == ("request_timeout", timeout_error(TIMEOUT_S).message)
        text = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
        done = [e.item for e in seen if e.type == "response.output_item.done"]
        assert [(i.type, i.status) for i in done] == [("message", "incomplete")]
        assert done[0].content[0].text == text and text
        failed = seen[-1].response
        assert failed.status == "failed" and failed.incomplete_details is None
        # OpenAI's response error codes are a closed set: the timeout is a server_error there,
        # its own code kept as the error's type (the error event carries it as it is).
        assert (failed.error.code, failed.error.message) == ("server_error", error.message)
        assert failed.error.type == "request_timeout"
        assert [item.model_dump() for item in failed.output] == [done[0].model_dump()]
        ends.append(failed)
    # The background response's record is what its stream ended with.
    stored = client.responses.retrieve(ends[1].id)
    assert stored.status == "failed" and stored.background is True
    assert [item.model_dump() for item in stored.output] == [item.model_dump() for item in ends[1].output]
    assert stored.output[0].status == "incomplete"


def _chunk(delta: DeltaMessage) -> ChatCompletionChunk:
    return ChatCompletionChunk(id="c", created=0, model="m", choices=[ChatStreamChoice(index=0, delta=delta)])


async def test_a_function_call_cut_by_a_failure_is_incomplete() -> None:
    """Text, then a named function's call whose arguments were streaming when the request failed:
    the message is done ``completed`` when the call starts, the call ``incomplete`` at the failure
    (it was left out of the output before)."""
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    req = ResponsesRequest.model_validate(
        {"input": "hi", "stream": True, "tools": tools, "tool_choice": {"type": "function", "name": "f"}}
    )
    built = _Response(req, "m", "req-1")

    async def chunks() -> AsyncIterator[ChatCompletionChunk]:
        yield _chunk(DeltaMessage(content="Sure."))
        call = DeltaToolCall(index=0, id="call_1", type="function", function=DeltaFunctionCall(name="f"))
        yield _chunk(DeltaMessage(tool_calls=[call]))
        yield _chunk(
            DeltaMessage(tool_calls=[DeltaToolCall(index=0, function=DeltaFunctionCall(arguments='{"a'))])
        )
        raise timeout_error(3)

    async def save() -> None:
        pass

    frames = [frame async for frame in events(built, chunks(), save, want_logprobs=False)]
    seen = [json.loads(frame.decode().split("data: ", 1)[1]) for frame in frames]
    done = [e["item"] for e in seen if e["type"] == "response.output_item.done"]
    assert [(i["type"], i["status"]) for i in done] == [
        ("message", "completed"),
        ("function_call", "incomplete"),
    ]
    assert done[1]["arguments"] == '{"a' and done[1]["call_id"] == "call_1"
    assert [e["type"] for e in seen][-2:] == ["error", "response.failed"]
    assert seen[-1]["response"]["output"] == done
    assert built.status == "failed" and built.output == done
