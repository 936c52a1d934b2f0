"""A Responses answer's output items are the same whether it is streamed or not: items in the
order the model wrote them, text after a function call a message item after that call (OpenAI's
output list), never folded into the first message.

The app runs in process over a real engine with the Hermes tool-call parser. The random model is
steered to a Hermes answer with text between two calls by a regex constraint put on the chat
request the Responses request becomes (the Responses API itself takes no regex); everything else
(engine, detokenizer, tool parser, chat stream, Responses translation, store) is what serves.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

import server.serving_responses as serving_responses
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from server.app import build_app
from server.chat_protocol import ChatCompletionChunk, ChatStreamChoice, DeltaMessage
from server.chat_stream import sse_frames
from server.config import ServerConfig
from server.protocol import StructuredOutputsField

ANSWER = (
    'Hello <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call> after'
    '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
)
TOOLS = [
    {"type": "function", "name": name, "parameters": {"type": "object", "properties": {}}} for name in "fg"
]
BODY = {"model": "m", "input": "hi", "tools": TOOLS, "max_output_tokens": 300, "temperature": 0.0}
EXPECTED = [
    ("message", "Hello "),
    ("function_call", "f", '{"a": 1}'),
    ("message", " after"),
    ("function_call", "g", "{}"),
]


@pytest.fixture(scope="module")
async def engine(tiny_llama) -> AsyncIterator[AsyncEngine]:
    eng = AsyncEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=128))
    yield eng
    await eng.shutdown()


@pytest.fixture
def steered(monkeypatch) -> None:
    """The chat request of every Responses request constrained to ``ANSWER``."""
    translate = serving_responses.to_chat_request

    def to_chat_request(*args: Any, **kwargs: Any):
        chat = translate(*args, **kwargs)
        chat.structured_outputs = StructuredOutputsField(regex=_regex(ANSWER))
        return chat

    monkeypatch.setattr(serving_responses, "to_chat_request", to_chat_request)


def _regex(text: str) -> str:
    return "".join("\\" + c if c in "\\.^$|?*+()[]{}" else c for c in text)


def _shape(output: list[dict[str, Any]]) -> list[tuple]:
    return [
        ("message", item["content"][0]["text"])
        if item["type"] == "message"
        else (item["type"], item["name"], item["arguments"])
        for item in output
    ]


async def test_streamed_and_whole_output_agree_when_text_follows_a_call(engine, serve_app, steered) -> None:
    config = ServerConfig(served_model_name="m", enable_auto_tool_choice=True, tool_call_parser="hermes")
    async with (
        serve_app(build_app(engine, config)) as url,
        httpx.AsyncClient(base_url=url, timeout=60) as client,
    ):
        whole = (await client.post("/v1/responses", json=BODY)).json()
        events = []
        async with client.stream("POST", "/v1/responses", json={**BODY, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
        stored = (await client.get(f"/v1/responses/{whole['id']}")).json()
    assert whole["status"] == "completed" and _shape(whole["output"]) == EXPECTED
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and _shape(final["output"]) == EXPECTED
    assert _shape(stored["output"]) == EXPECTED
    assert whole["usage"]["output_tokens"] == final["usage"]["output_tokens"] > 0
    # Each item's place in the stream is its place in the output.
    added = [
        (e["output_index"], e["item"]["type"]) for e in events if e["type"] == "response.output_item.added"
    ]
    assert added == [(i, kind) for i, (kind, *_) in enumerate(EXPECTED)]


@pytest.fixture
def one_delta(engine, fold_deltas) -> None:
    """The engine's outputs of each request folded into one delta, as a slow client's stream gets
    them (``merge_pending``): the tool parser sees the whole answer at once."""
    fold_deltas(engine)


async def test_an_answer_in_one_delta_keeps_text_after_its_call(
    engine, serve_app, steered, one_delta
) -> None:
    config = ServerConfig(served_model_name="m", enable_auto_tool_choice=True, tool_call_parser="hermes")
    chat_body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [
            {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS
        ],
        "max_tokens": 300,
        "temperature": 0.0,
        "stream": True,
        "structured_outputs": {"regex": _regex(ANSWER)},
    }
    async with (
        serve_app(build_app(engine, config)) as url,
        httpx.AsyncClient(base_url=url, timeout=60) as client,
    ):
        events = []
        async with client.stream("POST", "/v1/responses", json={**BODY, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
        chunks = []
        async with client.stream("POST", "/v1/chat/completions", json=chat_body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:])["choices"][0])
    assert events[-1]["type"] == "response.completed"
    assert _shape(events[-1]["response"]["output"]) == EXPECTED
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert added == [kind for kind, *_ in EXPECTED]
    # The chat stream: the text after a call comes in a chunk after the call's.
    shown = [
        (c["delta"].get("content"), [t["function"]["name"] for t in c["delta"].get("tool_calls") or []])
        for c in chunks[1:]
    ]
    assert shown == [("Hello ", ["f"]), (" after", ["g"])]
    assert [c["finish_reason"] for c in chunks] == [None, None, "tool_calls"]


async def test_chunks_of_one_output_leave_in_one_write() -> None:
    """A chunk marked ``continued`` (text after a call, in one engine output) goes out with the
    next: a router resuming from the token ids on an output's last chunk never has the text of an
    earlier one without them."""

    def chunk(content: str, finish: str | None = None, continued: bool = False) -> ChatCompletionChunk:
        choice = ChatStreamChoice(index=0, delta=DeltaMessage(content=content), finish_reason=finish)
        c = ChatCompletionChunk(id="c", created=0, model="m", choices=[choice])
        c.continued = continued
        return c

    async def chunks() -> AsyncIterator[ChatCompletionChunk]:
        for c in [chunk("a"), chunk("b", continued=True), chunk("c"), chunk("d", "stop")]:
            yield c

    frames = [bytes(f) async for f in sse_frames(chunks(), 1)]
    contents = [
        [
            json.loads(line[6:])["choices"][0]["delta"]["content"]
            for line in f.decode().split("\n\n")
            if line.startswith("data: {")
        ]
        for f in frames
    ]
    assert contents == [["a"], ["b", "c"], ["d"]]
    assert b"continued" not in b"".join(frames)
