"""A streamed Responses answer closes each function call as soon as its arguments are complete, as
OpenAI streams them: the call's ``function_call_arguments.done`` and ``output_item.done`` come
before the next item's ``output_item.added``, not when the answer ends; the completed response is
still the non-streamed one.

The app runs in process over a real engine, with each tool-call parser in turn; the random model is
steered to an answer of that parser's format with two calls (and text before them, where the format
has any) by a regex constraint put on the chat request the Responses request becomes (the Responses
API itself takes no regex), as ``test_responses_output_order.py`` does. Everything else (engine,
detokenizer, tool parser, chat stream, Responses translation) is what serves, read with the official
SDK. A resumed stream (router failover) after a closed call keeps it closed: replica events spliced
through the router's tracker, as ``tests/router/test_responses_stream.py`` drives them.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from openai import omit
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

import server.serving_responses as serving_responses
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from router.responses_stream import ResponsesTracker
from router.sse import SSESplitter
from server.app import build_app
from server.chat_protocol import (
    ChatCompletionChunk,
    ChatStreamChoice,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
)
from server.config import ServerConfig
from server.protocol import StructuredOutputsField, UsageInfo
from server.responses_object import _Response
from tests.router.test_responses_stream import replica

TOOLS = [
    {
        "type": "function",
        "name": "f",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
    },
    {"type": "function", "name": "g", "parameters": {"type": "object", "properties": {}}},
]
BODY = {"model": "m", "input": "hi", "tools": TOOLS, "max_output_tokens": 300, "temperature": 0.0}
CALLS = [("f", '{"a": 1}'), ("g", "{}")]

# parser -> (an answer calling f(a=1) then g(), the text before the calls)
ANSWERS = {
    "hermes": (
        'Hello <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\n'
        '<tool_call>{"name": "g", "arguments": {}}</tool_call>',
        "Hello ",
    ),
    "llama3_json": ('{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}', None),
    "mistral": (
        'Sure. [TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]',
        "Sure. ",
    ),
    "deepseek_v3": (
        "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n"
        '{"a": 1}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>g\n'
        "```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "Checking.",
    ),
    "deepseek_v31": (
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{"a": 1}<｜tool▁call▁end｜>'
        "<｜tool▁call▁begin｜>g<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        None,
    ),
    "kimi_k2": (
        "Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
        '{"a": 1}<|tool_call_end|><|tool_call_begin|>functions.g:1<|tool_call_argument_begin|>{}'
        "<|tool_call_end|><|tool_calls_section_end|>",
        "Sure.",
    ),
    "pythonic": ("[f(a=1), g()]", None),
    "llama4_pythonic": ("<|python_start|>[f(a=1), g()]<|python_end|>", None),
    "granite": ('<|tool_call|>[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]', None),
    "phi4_mini_json": (
        'functools[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]',
        None,
    ),
    "qwen3_coder": (
        "Let me look.\n<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=g>\n</function>\n</tool_call>",
        "Let me look.\n",
    ),
    "glm45": (
        "Checking.<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>\n"
        "<tool_call>g\n</tool_call>",
        "Checking.",
    ),
    "openai": ('to=functions.f<|message|>{"a": 1}<|call|>to=functions.g<|message|>{}<|call|>', None),
}


@pytest.fixture(scope="module")
async def engine(tiny_llama) -> AsyncIterator[AsyncEngine]:
    eng = AsyncEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=128))
    yield eng
    await eng.shutdown()


def _regex(text: str) -> str:
    return "".join("\\" + c if c in "\\.^$|?*+()[]{}" else c for c in text)


def _steer(monkeypatch, answer: str) -> None:
    """The chat request of every Responses request constrained to ``answer``."""
    translate = serving_responses.to_chat_request

    def to_chat_request(*args: Any, **kwargs: Any):
        chat = translate(*args, **kwargs)
        chat.structured_outputs = StructuredOutputsField(regex=_regex(answer))
        return chat

    monkeypatch.setattr(serving_responses, "to_chat_request", to_chat_request)


def _expected_order(text: str | None) -> list[tuple[str, int | None]]:
    """(type, output_index) of each event, a run of deltas as one: each item done before the next."""
    order: list[tuple[str, int | None]] = [("response.created", None), ("response.in_progress", None)]
    if text:
        order += [
            ("response.output_item.added", 0),
            ("response.content_part.added", 0),
            ("response.output_text.delta", 0),
            ("response.output_text.done", 0),
            ("response.content_part.done", 0),
            ("response.output_item.done", 0),
        ]
    first_call = 1 if text else 0
    for index in range(first_call, first_call + len(CALLS)):
        order += [
            ("response.output_item.added", index),
            ("response.function_call_arguments.delta", index),
            ("response.function_call_arguments.done", index),
            ("response.output_item.done", index),
        ]
    return [*order, ("response.completed", None)]


def _order(stream_events: list) -> list[tuple[str, int | None]]:
    order: list[tuple[str, int | None]] = []
    for e in stream_events:
        step = (e.type, getattr(e, "output_index", None))
        if not (e.type.endswith(".delta") and order and order[-1] == step):
            order.append(step)
    return order


def _without_ids(response) -> dict[str, Any]:
    """A response as a client compares two answers: without what names this one (its id, creation
    and completion times, item and call ids)."""
    body = response.model_dump(exclude={"id", "created_at", "completed_at"})
    body["output"] = [
        {k: v for k, v in item.items() if k not in ("id", "call_id")} for item in body["output"]
    ]
    return body


@pytest.mark.parametrize("parser", list(ANSWERS))
async def test_each_call_is_done_before_the_next_item_and_the_answer_is_the_whole_one(
    engine, serve_app, monkeypatch, parser
) -> None:
    answer, text = ANSWERS[parser]
    _steer(monkeypatch, answer)
    config = ServerConfig(served_model_name="m", enable_auto_tool_choice=True, tool_call_parser=parser)
    async with serve_app(build_app(engine, config)) as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        whole = await client.responses.create(**BODY)
        streamed = [e async for e in await client.responses.create(stream=True, **BODY)]
        await client.close()
    assert [e.sequence_number for e in streamed] == list(range(len(streamed)))
    assert _order(streamed) == _expected_order(text)
    first_call = 1 if text else 0
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert [(e.output_index, e.arguments) for e in done] == [
        (first_call + i, arguments) for i, (_, arguments) in enumerate(CALLS)
    ]
    # OpenAI's event names the function (the SDK keeps the field as an extra)
    assert [e.model_extra["name"] if "name" not in type(e).model_fields else e.name for e in done] == [
        name for name, _ in CALLS
    ]
    final = streamed[-1].response
    # Each item as it was done is the item in the final output, under its output index.
    items = {e.output_index: e.item for e in streamed if e.type == "response.output_item.done"}
    assert [items[i] for i in range(len(items))] == final.output
    calls = [(item.name, item.arguments, item.status) for item in final.output[first_call:]]
    assert calls == [(name, arguments, "completed") for name, arguments in CALLS]
    assert final.output_text == (text or "")
    assert final.status == whole.status == "completed"
    assert _without_ids(final) == _without_ids(whole)


# A resumed stream, scripted: chat chunks in, a replica's grouped events through the router's tracker.


def _chunk(ids: list[int], finish: str | None = None, **delta) -> ChatCompletionChunk:
    choice = ChatStreamChoice(index=0, delta=DeltaMessage(**delta), finish_reason=finish, token_ids=ids)
    return ChatCompletionChunk(id="c", created=0, model="m", choices=[choice])


def _whole_call(index: int, name: str, arguments: str) -> list[DeltaToolCall]:
    fn = DeltaFunctionCall(name=name, arguments=arguments)
    return [DeltaToolCall(index=index, id=f"call_{index}", type="function", function=fn)]


def _replica(chunks: list[ChatCompletionChunk], resume: dict | None = None) -> tuple[list[bytes], _Response]:
    """A replica's SSE events for ``chunks`` (grouped, as a router asks them), and its response."""
    return replica(chunks, resume, tools=TOOLS)


def _relay(tracker: ResponsesTracker, frames: list[bytes]) -> list[dict]:
    out = []
    for frame in frames:
        sent = tracker.process(frame)
        for one in SSESplitter().feed((sent or b"") + b"\n\n"):
            out.append(json.loads(one.split(b"\ndata: ", 1)[1]))
    return out


def test_a_call_done_before_a_failover_stays_done_on_the_resumed_replica() -> None:
    usage = UsageInfo(prompt_tokens=5, completion_tokens=1, total_tokens=6)
    first_call = _chunk([1, 2], tool_calls=_whole_call(0, "f", '{"a": 1}'))
    second_call = _chunk([3, 4], tool_calls=_whole_call(1, "g", "{}"))
    tracker = ResponsesTracker()
    frames, _ = _replica([first_call, second_call])
    client = _relay(tracker, frames[:3])  # created, in_progress, the first call's group: then it dies
    assert [(e["type"], e.get("output_index")) for e in client[2:]] == [
        ("response.output_item.added", 0),
        ("response.function_call_arguments.delta", 0),
        ("response.function_call_arguments.done", 0),
        ("response.output_item.done", 0),
    ]
    tracker.begin_failover()
    resume = tracker.resume_body({"input": "x"})["resume"]
    end = [
        _chunk([5], "tool_calls"),
        ChatCompletionChunk(id="c", created=0, model="m", choices=[], usage=usage),
    ]
    frames, built = _replica([second_call, *end], resume)
    client += _relay(tracker, frames)
    assert [e["sequence_number"] for e in client] == list(range(len(client)))
    assert [(e["type"], e.get("output_index")) for e in client[6:]] == [
        ("response.output_item.added", 1),
        ("response.function_call_arguments.delta", 1),
        ("response.function_call_arguments.done", 1),
        ("response.output_item.done", 1),
        ("response.completed", None),
    ]
    state = ResponseStreamState(input_tools=omit, text_format=omit)  # the SDK's own accumulator
    for e in client:
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=e))
    final = state._completed_response
    assert [(i.name, i.arguments, i.call_id) for i in final.output] == [
        ("f", '{"a": 1}', "call_0"),
        ("g", "{}", "call_1"),
    ]
    assert final.output[0].id == client[2]["item"]["id"]
    assert built.body()["output"] == client[-1]["response"]["output"]
