"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) on `ferry serve`,
driven by the official ``anthropic`` SDK: the same answer as chat completions for the same
conversation, Anthropic's event stream, stop sequences, tools both ways, its error shape and its
``x-api-key`` header."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Iterator
from functools import partial
from pathlib import Path

import anthropic
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.anthropic_protocol import MessagesRequest, error_response
from server.chat_protocol import (
    ChatCompletionChunk,
    ChatStreamChoice,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
)
from server.errors import APIError, overloaded, timeout_error, unavailable
from server.messages_events import MessageWriter
from server.protocol import UsageInfo
from server.serving_messages import PING_FRAME, _collect, _error_frame, _translate, to_chat_request
from server.streaming import KeepAlive, SSEResponse
from tests.server.error_cases import json_values

SYSTEM = "You are terse."
GREEDY = {"temperature": 0.0}
# Renders tools, calls and tool results, so a conversation with them shows in the prompt.
TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% elif m.content %}{% for p in m.content %}{{ p.text }}"
    "{% endfor %}{% endif %}"
    "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }}</call>{% endfor %}"
    "{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [
    {
        "name": "get_weather",
        "description": "The weather in a city.",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
        },
    }
]
HISTORY = [
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
        ],
    },
    {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "4 C, rain"},
            {"type": "text", "text": "And tomorrow?"},
        ],
    },
]


@pytest.fixture(scope="module")
def srv(tiny_llama: Path, serve_logs: Path, server_process, tmp_path_factory) -> Iterator:
    template = tmp_path_factory.mktemp("template") / "tools.jinja"
    template.write_text(TEMPLATE)
    flags = ["--api-key", "k3y", "--chat-template", str(template), "--num-kv-blocks", "256"]
    server = server_process(tiny_llama, flags, serve_logs).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(srv) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key="k3y", max_retries=0, timeout=60)


def _chat(srv, messages: list[dict], **extra) -> dict:
    body = {"model": srv.model_name, "messages": messages, **extra}
    r = httpx.post(
        srv.url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer k3y"}, timeout=60
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_message_equals_chat_completion(srv, client) -> None:
    def ask():  # noqa: ANN202
        return client.messages.create(
            model=srv.model_name,
            max_tokens=8,
            system=SYSTEM,
            messages=[{"role": "user", "content": "Name a color."}],
            extra_body=GREEDY,
        )

    m = ask()
    chat = _chat(
        srv,
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a color."}],
        max_tokens=8,
        **GREEDY,
    )
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant"
    assert m.model == srv.model_name
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == chat["choices"][0]["message"]["content"]
    assert (m.stop_reason, m.stop_sequence) == ("max_tokens", None)
    usage = chat["usage"]
    assert m.usage.output_tokens == usage["completion_tokens"] == 8
    # Anthropic's accounting: prompt tokens read from the cache are not input_tokens.
    cached = m.usage.cache_read_input_tokens
    assert m.usage.input_tokens + cached == usage["prompt_tokens"]
    assert ask().usage.cache_read_input_tokens > 0  # the same prompt's full blocks, cached


def test_stream_is_anthropics_event_sequence(srv, client) -> None:
    body = {
        "model": srv.model_name,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "Name a color."}],
        "stream": True,
        **GREEDY,
    }
    with httpx.stream(
        "POST", srv.url + "/v1/messages", json=body, headers={"x-api-key": "k3y"}, timeout=60
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        frames = [f for f in r.read().decode().split("\n\n") if f]
    events = []
    for frame in frames:
        kind, data = frame.split("\n", 1)
        payload = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {payload['type']}"
        events.append(payload)
    kinds = [e["type"] for e in events]
    # A ping right after message_start, as Anthropic's streams send one (SDKs skip it).
    assert kinds[:3] == ["message_start", "ping", "content_block_start"] and events[1] == {"type": "ping"}
    assert frames[1] == 'event: ping\ndata: {"type": "ping"}'
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    assert events[2]["content_block"] == {"type": "text", "text": ""} and events[2]["index"] == 0
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    whole = client.messages.create(
        model=srv.model_name,
        max_tokens=8,
        messages=[{"role": "user", "content": "Name a color."}],
        extra_body=GREEDY,
    )
    assert text == whole.content[0].text
    assert events[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert events[-2]["usage"]["output_tokens"] == 8
    start = events[0]["message"]["usage"]
    assert start["input_tokens"] + start["cache_read_input_tokens"] == whole.usage.input_tokens + (
        whole.usage.cache_read_input_tokens or 0
    )
    # The SDK's own stream helper assembles the same message.
    with client.messages.stream(
        model=srv.model_name,
        max_tokens=8,
        messages=[{"role": "user", "content": "Name a color."}],
        extra_body=GREEDY,
    ) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == text and final.stop_reason == "max_tokens"


def test_usage_is_anthropics_in_whole_answers_and_both_ends_of_a_stream(srv, client) -> None:
    """``usage`` has Anthropic's fields: the prompt split into computed and cached tokens, no paid
    cache entry ever created, the standard tier; a stream's ``message_delta`` repeats the input
    counts, cumulative, with the output's (the SDK's ``MessageDeltaUsage``), so the SDK's streamed
    message has the usage a whole answer has."""
    kw = dict(
        model=srv.model_name,
        max_tokens=8,
        messages=[{"role": "user", "content": "Usage of a cumulative stream, please."}],
        extra_body=GREEDY,
    )
    chat = _chat(srv, kw["messages"], max_tokens=8, **GREEDY)  # its prompt's full blocks now cached
    whole = client.messages.create(**kw).model_dump(exclude_none=True)["usage"]
    prompt, cached = chat["usage"]["prompt_tokens"], whole["cache_read_input_tokens"]
    assert cached > 0 and whole == {
        "input_tokens": prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0},
        "output_tokens": 8,
        "service_tier": "standard",
    }
    with client.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    start = next(e for e in events if e.type == "message_start").message.usage.model_dump(exclude_none=True)
    delta = next(e for e in events if e.type == "message_delta").usage.model_dump(exclude_none=True)
    assert start == {**whole, "output_tokens": 0}
    inputs = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
    assert delta == {**{k: whole[k] for k in inputs}, "output_tokens": 8}
    assert final.usage.model_dump(exclude_none=True) == whole


def test_stop_sequence_ends_the_turn_and_is_named(srv, client) -> None:
    messages = [{"role": "user", "content": "Count."}]
    full = client.messages.create(model=srv.model_name, max_tokens=12, messages=messages, extra_body=GREEDY)
    stop = full.content[0].text[3:5]
    m = client.messages.create(
        model=srv.model_name, max_tokens=12, messages=messages, stop_sequences=[stop], extra_body=GREEDY
    )
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
    assert full.content[0].text.startswith(m.content[0].text) and stop not in m.content[0].text


def _call_then_end(finish_reason: str, stop: str | None) -> list[ChatCompletionChunk]:
    """The chat chunks of an answer that writes a call, then text, then ends (``stop``: the stop
    string that ended it), as ``chat_stream`` sends them."""

    def chunk(delta: DeltaMessage, **end) -> ChatCompletionChunk:  # noqa: ANN003
        choice = ChatStreamChoice(index=0, delta=delta, **end)
        return ChatCompletionChunk(id="c", created=0, model="m", choices=[choice])

    call = DeltaToolCall(
        index=0, id="call_1", type="function", function=DeltaFunctionCall(name="get_weather", arguments="{}")
    )
    usage = UsageInfo(prompt_tokens=5, completion_tokens=9, total_tokens=14)
    return [
        chunk(DeltaMessage(role="assistant")),
        chunk(DeltaMessage(tool_calls=[call])),
        chunk(DeltaMessage(content="ok"), finish_reason=finish_reason, stop_reason=stop),
        ChatCompletionChunk(id="c", created=0, model="m", choices=[], usage=usage),
    ]


@pytest.mark.parametrize(
    ("finish_reason", "stop", "stop_sequences", "expected"),
    [
        # A stop sequence ended the turn after a call: named, and the reason stays the call.
        ("tool_calls", "END", ["END"], ("tool_use", "END")),
        ("stop", "END", ["END"], ("tool_use", "END")),  # a named tool's chat says "stop"
        ("tool_calls", None, ["END"], ("tool_use", None)),
        ("stop", None, None, ("tool_use", None)),
        ("tool_calls", 7, None, ("tool_use", None)),  # a stop token is not a stop sequence
        ("length", None, ["END"], ("max_tokens", None)),
    ],
)
async def test_stop_reason_after_a_tool_call(finish_reason, stop, stop_sequences, expected) -> None:
    body = {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    req = MessagesRequest.model_validate({**body, "stop_sequences": stop_sequences})

    async def chunks():  # noqa: ANN202
        for c in _call_then_end(finish_reason, stop):
            yield c

    whole = await _collect(MessageWriter(req, "msg_1", "m"), chunks())
    delta = {"stop_reason": expected[0], "stop_sequence": expected[1]}
    usage = {
        "input_tokens": 5,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": 9,
    }
    assert [e for e in whole if e[0] == "message_delta"] == [
        ("message_delta", {"delta": delta, "usage": usage})
    ]
    frames = b"".join([f async for f in _translate(MessageWriter(req, "msg_1", "m"), chunks())]).decode()
    streamed = [json.loads(line[6:]) for line in frames.splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in streamed] == [
        "message_start",
        "ping",
        *("content_block_start", "content_block_delta", "content_block_stop"),  # the call
        *("content_block_start", "content_block_delta", "content_block_stop"),  # the text
        "message_delta",
        "message_stop",
    ]
    assert streamed[-2] == {"type": "message_delta", "delta": delta, "usage": usage}


def test_tool_history_renders_as_chat_tool_calls_and_results(srv, client) -> None:
    req = MessagesRequest.model_validate(
        {"model": "m", "max_tokens": 4, "system": SYSTEM, "messages": HISTORY, "tools": TOOLS}
    )
    chat = to_chat_request(req).model_dump(exclude_none=True)
    assert [(m["role"], m.get("tool_call_id")) for m in chat["messages"]] == [
        ("system", None),
        ("user", None),
        ("assistant", None),
        ("tool", "toolu_1"),
        ("user", None),
    ]
    call = chat["messages"][2]["tool_calls"][0]
    assert call["id"] == "toolu_1" and call["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Oslo"}',
    }
    assert chat["messages"][3]["content"] == "4 C, rain"
    assert chat["tools"][0]["function"]["parameters"] == TOOLS[0]["input_schema"]
    # Over HTTP: the same prompt as the chat conversation, token for token counted.
    counted = client.messages.count_tokens(model=srv.model_name, system=SYSTEM, messages=HISTORY, tools=TOOLS)
    tokens = httpx.post(
        srv.url + "/tokenize",
        json={"model": srv.model_name, "messages": chat["messages"], "tools": chat["tools"]},
        headers={"Authorization": "Bearer k3y"},
    ).json()["tokens"]
    assert counted.input_tokens == len(tokens)
    text = httpx.post(
        srv.url + "/detokenize", json={"tokens": tokens}, headers={"Authorization": "Bearer k3y"}
    )
    assert "<call>get_weather</call>" in text.json()["prompt"] and "[toolu_1]" in text.json()["prompt"]


def test_forced_tool_use_answers_with_a_tool_use_block(srv, client) -> None:
    forced = {
        "model": srv.model_name,
        "max_tokens": 64,
        "messages": HISTORY,
        "tools": TOOLS,
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "extra_body": GREEDY,
    }
    m = client.messages.create(**forced)
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id
    assert set(uses[0].input) == {"city"} and isinstance(uses[0].input["city"], str)
    assert m.stop_reason == "tool_use"
    with client.messages.stream(**forced) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [e for e in events if e.type == "content_block_start" and e.content_block.type == "tool_use"]
    assert len(starts) == 1 and starts[0].content_block.name == "get_weather"
    partial = "".join(
        e.delta.partial_json
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    )
    assert json.loads(partial) == uses[0].input
    assert [b.type for b in final.content] == [b.type for b in m.content] and final.stop_reason == "tool_use"


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"max_tokens": 4}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        (
            {
                "max_tokens": 4,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"},
                            }
                        ],
                    }
                ],
            },
            "text only",
        ),
        ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, "role"),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "x"}],
                "tool_choice": {"type": "tool"},
            },
            "name",
        ),
        (  # Anthropic's server tools are refused by type, not as a tool missing input_schema
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            },
            "'tools.0': tool type 'web_search_20250305' is not supported",
        ),
        (  # tools without a tool_choice are "auto", which needs a tool-call parser: the way out in
            # the Messages API's words
            {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "tools": TOOLS},
            'send tool_choice {"type": "any"}, {"type": "none"} or {"type": "tool", "name": ...} instead',
        ),
    ],
)
def test_bad_requests_are_anthropic_400s(srv, body, needle) -> None:
    r = httpx.post(
        srv.url + "/v1/messages", json={"model": srv.model_name, **body}, headers={"x-api-key": "k3y"}
    )
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert needle in error["error"]["message"]


def test_invalid_json_unknown_model_and_wrong_key(srv, client) -> None:
    r = httpx.post(
        srv.url + "/v1/messages",
        content=b"{",
        headers={"x-api-key": "k3y", "content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="nope", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "not_found_error"
    wrong = anthropic.Anthropic(base_url=srv.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as denied:
        wrong.messages.create(model=srv.model_name, max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert denied.value.body == {  # answered before the app, in Anthropic's shape all the same
        "type": "error",
        "error": {"type": "authentication_error", "message": "Invalid or missing API key."},
        "request_id": denied.value.request_id,
    }
    assert httpx.get(srv.url + "/health").status_code == 200


def test_answers_and_errors_name_their_request_as_anthropics(srv, client) -> None:
    """Anthropic's ``request-id`` header (the SDK's ``_request_id``, ``APIStatusError.request_id``)
    on answers and errors, and the error body's ``request_id``: the same id as ``x-request-id``."""
    raw = client.messages.with_raw_response.create(
        model=srv.model_name, max_tokens=1, messages=[{"role": "user", "content": "x"}]
    )
    assert raw.parse()._request_id == raw.headers["x-request-id"]
    with pytest.raises(anthropic.NotFoundError) as e:  # the app's error
        client.messages.create(model="nope", max_tokens=1, messages=[{"role": "user", "content": "x"}])
    assert e.value.request_id == e.value.body["request_id"] == e.value.response.headers["x-request-id"]
    r = httpx.post(srv.url + "/v1/messages", json={}, headers={"x-api-key": "k3y", "x-request-id": "mine"})
    assert r.status_code == 400 and r.headers["request-id"] == r.json()["request_id"] == "mine"
    denied = httpx.post(srv.url + "/v1/messages", json={})  # the middleware's
    assert denied.status_code == 401 and denied.json()["request_id"] == denied.headers["request-id"]
    chat = httpx.post(srv.url + "/v1/chat/completions", json={}, headers={"x-api-key": "k3y"})
    assert "request-id" not in chat.headers and "request_id" not in chat.json()  # OpenAI's API: its own


def test_edge_refusals_on_the_messages_api_are_anthropics(srv, client) -> None:
    """What is refused before a handler runs (no route, a method the route has not, a body past
    ``--max-request-bytes``) takes Anthropic's shape on ``/v1/messages`` paths, which the SDK reads
    into its typed errors; each names its request in ``request-id``."""
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.get("/v1/messages/nowhere", cast_to=object)
    assert missing.value.body["error"]["type"] == "not_found_error"
    assert missing.value.request_id == missing.value.body["request_id"]
    with pytest.raises(anthropic.APIStatusError) as method:
        client.get("/v1/messages", cast_to=object)
    assert method.value.status_code == 405 and method.value.body["error"]["type"] == "invalid_request_error"
    assert method.value.request_id == method.value.body["request_id"]
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:  # declared too large
        sock.sendall(
            b"POST /v1/messages HTTP/1.1\r\nhost: x\r\nx-api-key: k3y\r\nconnection: close\r\n"
            b"x-request-id: big-1\r\ncontent-length: %d\r\n\r\n" % (1 << 40)
        )
        wire = b""
        while data := sock.recv(65536):
            wire += data
    head, _, body = wire.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 ") and b"\r\nrequest-id: big-1" in head
    error = json.loads(body)
    assert error["type"] == "error" and error["request_id"] == "big-1"
    assert error["error"]["type"] == "request_too_large"


def test_output_config_format_constrains_the_answer(srv, client) -> None:
    """Structured outputs: ``output_config.format`` (and the beta's ``output_format``) is the chat
    request's ``response_format`` JSON schema, whole and streamed."""
    ask = {"model": srv.model_name, "max_tokens": 16, "messages": [{"role": "user", "content": "Yes?"}]}
    fmt = {"type": "json_schema", "schema": {"enum": ["yes", "no"]}}
    m = client.messages.create(**ask, output_config={"format": fmt})
    assert json.loads(m.content[0].text) in ("yes", "no") and m.stop_reason == "end_turn"
    with client.messages.stream(**ask, extra_body={"output_format": fmt}) as stream:
        text = "".join(stream.text_stream)
    assert json.loads(text) in ("yes", "no")


_valid_block = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, st.text(max_size=12)),
    st.builds(
        lambda i, c: {"type": "tool_use", "id": i, "name": "get_weather", "input": {"city": c}},
        st.text(min_size=1, max_size=4),
        st.text(max_size=6),
    ),
    st.builds(
        lambda i, c: {"type": "tool_result", "tool_use_id": i, "content": c},
        st.text(max_size=4),
        st.text(max_size=8) | st.just([{"type": "text", "text": "r"}]),
    ),
)
_block = _valid_block | st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "tool_use", "thinking", "image", "document", "x"]) | json_values},
    optional={
        "text": json_values,
        "id": json_values,
        "name": json_values,
        "input": json_values,
        "source": json_values | st.just({"type": "text", "media_type": "text/plain", "data": "d"}),
        "title": json_values,
        "citations": json_values,
    },
)
_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "user", "user", "assistant", "assistant", "system"]),
        "content": st.text(max_size=16) | st.lists(_valid_block, max_size=3) | st.lists(_block, max_size=2),
    }
)
_bodies = st.fixed_dictionaries(
    {"messages": st.lists(_message, min_size=1, max_size=3), "max_tokens": st.integers(1, 3)},
    optional={
        "system": st.text(max_size=8),
        "stop_sequences": st.lists(st.text(min_size=1, max_size=3), max_size=2),
        "stream": st.booleans(),
        "temperature": st.floats(0, 2),
        "tools": st.just(TOOLS),
        "tool_choice": st.sampled_from(
            [{"type": "auto"}, {"type": "any"}, {"type": "tool", "name": "get_weather"}]
        ),
        "thinking": st.just({"type": "enabled", "budget_tokens": 16}),
    },
)
# Anything at all in the fields the API reads, for the validation paths.
_junk = st.dictionaries(
    st.sampled_from(
        ["messages", "max_tokens", "system", "stop_sequences", "tools", "tool_choice", "temperature"]
    ),
    json_values,
)


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(
    body=_bodies | st.dictionaries(st.sampled_from(["messages", "max_tokens", "tools"]), json_values),
    path=st.sampled_from(["/v1/messages", "/v1/messages/count_tokens"]),
)
def test_fuzz_never_5xx(srv, body: object, path: str) -> None:
    if isinstance(body, dict):
        body = {"model": srv.model_name, **body}
        if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 3:
            body["max_tokens"] = 3
    r = httpx.post(
        srv.url + path,
        content=json.dumps(body, allow_nan=False),
        headers={"x-api-key": "k3y", "content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        error = r.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.rstrip().endswith('data: {"type": "message_stop"}') or "event: error" in r.text
        assert "api_error" not in r.text


def test_claude_codes_billing_line_is_not_in_the_prompt(srv, client) -> None:
    """Claude Code's first system block names a per-request hash: left out of the prompt (which
    the prefix cache would otherwise never match), whether a block or a string's first line."""
    ask = {"model": srv.model_name, "messages": [{"role": "user", "content": "x"}]}
    plain = client.messages.count_tokens(**ask, system=SYSTEM).input_tokens
    billing = "x-anthropic-billing-header: cc_version=2.1.100.7b4; cc_entrypoint=cli; cch=eb6c6;"
    blocks = [{"type": "text", "text": billing}, {"type": "text", "text": SYSTEM}]
    assert client.messages.count_tokens(**ask, system=blocks).input_tokens == plain
    assert client.messages.count_tokens(**ask, system=f"{billing}\n{SYSTEM}").input_tokens == plain


# A plain text document and the same text as a content document (a block a chunk), and how the
# prompt shows either (``DocumentBlock.text``).
_FACTS = "Grass is green.\nThe sky is blue."
TEXT_DOCUMENT = {
    "type": "document",
    "source": {"type": "text", "media_type": "text/plain", "data": _FACTS},
    "title": "Facts",
    "context": "From a primer.",
}
CONTENT_DOCUMENT = {
    "type": "document",
    "source": {"type": "content", "content": [{"type": "text", "text": line} for line in _FACTS.split("\n")]},
    "title": "Facts",
    "context": "From a primer.",
    "citations": {"enabled": False},
}
RENDERED_DOCUMENT = (
    "<document>\n<title>Facts</title>\n<context>From a primer.</context>\n"
    f"<document_content>\n{_FACTS}\n</document_content>\n</document>"
)


@pytest.mark.parametrize("document", [TEXT_DOCUMENT, CONTENT_DOCUMENT], ids=["text", "content"])
def test_text_documents_are_read_into_the_prompt(srv, client, document) -> None:
    """A text document is its text, with its title and context, in its place in the user's turn:
    the same prompt (counted, and answered) as a chat message with that text."""
    question = {"type": "text", "text": "What colour is grass?"}
    messages = [{"role": "user", "content": [document, question]}]
    chat_messages = [{"role": "user", "content": [{"type": "text", "text": RENDERED_DOCUMENT}, question]}]
    counted = client.messages.count_tokens(model=srv.model_name, messages=messages).input_tokens
    tokenized = httpx.post(
        srv.url + "/tokenize",
        json={"model": srv.model_name, "messages": chat_messages},
        headers={"Authorization": "Bearer k3y"},
    ).json()
    assert counted == tokenized["count"]
    prompt = httpx.post(
        srv.url + "/detokenize", json={"tokens": tokenized["tokens"]}, headers={"Authorization": "Bearer k3y"}
    ).json()["prompt"]
    assert RENDERED_DOCUMENT in prompt
    m = client.messages.create(model=srv.model_name, max_tokens=6, messages=messages, extra_body=GREEDY)
    chat = _chat(srv, chat_messages, max_tokens=6, **GREEDY)
    assert m.content[0].text == chat["choices"][0]["message"]["content"]
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == counted


def test_a_document_in_a_tool_result_is_its_text(srv) -> None:
    history = [*HISTORY[:2], {**HISTORY[2], "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "4 C"}, TEXT_DOCUMENT]},
        {"type": "text", "text": "And tomorrow?"},
    ]}]  # fmt: skip
    req = MessagesRequest.model_validate({"model": "m", "max_tokens": 4, "messages": history, "tools": TOOLS})
    tool = to_chat_request(req).model_dump(exclude_none=True)["messages"][2]
    assert tool == {"role": "tool", "tool_call_id": "toolu_1", "content": f"4 C\n{RENDERED_DOCUMENT}"}


@pytest.mark.parametrize(
    ("source", "extra", "needle"),
    [
        (
            {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0xLjQK"},
            {},
            "content block 0 (document): 'source': document source type 'base64' (a PDF) is not supported",
        ),
        (
            {"type": "url", "url": "https://example.com/a.pdf"},
            {},
            "document source type 'url' (a URL) is not supported: this server reads text documents only",
        ),
        (
            {"type": "content", "content": [{"type": "image", "source": {"type": "url", "url": "u"}}]},
            {},
            "content block 0 (image) of a content document is not supported",
        ),
        (
            TEXT_DOCUMENT["source"],
            {"citations": {"enabled": True}},
            "content block 0 (document): 'citations': citations are not supported by this server",
        ),
    ],
    ids=["pdf", "url", "image-chunk", "citations"],
)
def test_documents_this_server_cannot_read_are_400s(srv, client, source, extra, needle) -> None:
    messages = [{"role": "user", "content": [{"type": "document", "source": source, **extra}]}]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=srv.model_name, max_tokens=2, messages=messages)
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert needle in e.value.body["error"]["message"], e.value.body
    with pytest.raises(anthropic.BadRequestError):  # its count too
        client.messages.count_tokens(model=srv.model_name, messages=messages)


def test_capacity_errors_are_anthropics_529_overloaded() -> None:
    """Ferry's capacity answers (a full queue's 429, a draining or unready server's 503) are
    Anthropic's 529 ``overloaded_error`` on the Messages API, Retry-After kept; others keep theirs."""
    for error in (overloaded("Server is overloaded."), unavailable("draining")):
        r = error_response(error, "req_1")
        assert r.status_code == 529 and r.headers["retry-after"] == error.headers["Retry-After"]
        assert json.loads(r.body)["error"]["type"] == "overloaded_error"
    assert json.loads(error_response(APIError(504, "slow")).body)["error"]["type"] == "timeout_error"
    assert "x-ferry-request-timeout" not in error_response(APIError(504, "slow")).headers


async def test_a_request_timeout_is_anthropics_504_timeout_error() -> None:
    """A request past ``--request-timeout`` (ferry's 408, as the OpenAI endpoints keep it) is
    Anthropic's 504 ``timeout_error`` on the Messages API (the SDK's ``GatewayTimeoutError``),
    marked as the request's own answer for a router (not retried elsewhere): as an answer, as the
    status of a stream that timed out before message_start, and as the ``error`` event of one that
    had begun."""
    timed_out = timeout_error(5)
    answer = error_response(timed_out, "req_1")
    assert answer.status_code == 504 and answer.headers["x-ferry-request-timeout"] == "1"
    error = {"type": "timeout_error", "message": "Request timed out after 5 s (server --request-timeout)."}
    assert json.loads(answer.body) == {"type": "error", "error": error, "request_id": "req_1"}
    assert timed_out.to_response().status_code == 408  # the OpenAI endpoints' answer

    req = MessagesRequest.model_validate(
        {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    )
    usage = UsageInfo(prompt_tokens=5, completion_tokens=1, total_tokens=6)

    async def chunks(texts: list[str]) -> AsyncIterator[ChatCompletionChunk]:
        for text in texts:
            choice = ChatStreamChoice(index=0, delta=DeltaMessage(content=text))
            yield ChatCompletionChunk(id="c", created=0, model="m", choices=[choice], usage=usage)
        raise timed_out

    start, body = await _answer_of(_translate(MessageWriter(req, "msg_1", "m"), chunks([])), interval=5.0)
    assert start["status"] == 504 and (b"x-ferry-request-timeout", b"1") in start["headers"]
    assert json.loads(body["body"]) == {"type": "error", "error": error, "request_id": "r1"}

    sent = await _answer_of(_translate(MessageWriter(req, "msg_1", "m"), chunks(["Once"])), interval=5.0)
    assert sent[0]["status"] == 200
    frames = [f for b in _bodies(sent) for f in b.decode().split("\n\n") if f]
    events = [json.loads(f.split("data: ", 1)[1]) for f in frames]
    assert [e["type"] for e in events] == [
        "message_start", "ping", "content_block_start", "content_block_delta", "error"
    ]  # fmt: skip
    assert events[-1] == {"type": "error", "error": error}


async def _answer_of(frames: AsyncIterator[bytes], interval: float = 0.05) -> list[dict]:
    """What the Messages API's stream response sends (its keep-alive every ``interval``) for ``frames``."""
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:  # a client that stays
        await asyncio.Event().wait()
        return {}

    keepalive = KeepAlive(interval, PING_FRAME, _error_frame)
    refusal = partial(error_response, request_id="r1")
    await SSEResponse(frames, hold_start=True, error_response=refusal, keepalive=keepalive)({}, receive, send)
    return sent


def _bodies(sent: list[dict]) -> list[bytes]:
    assert all(m["type"] == "http.response.body" for m in sent[1:]) and not sent[-1]["more_body"]
    assert all(m["more_body"] for m in sent[1:-1])
    return [m["body"] for m in sent[1:]]


async def test_a_silent_stream_sends_pings_until_its_frames_come() -> None:
    async def slow() -> AsyncIterator[bytes]:
        await asyncio.sleep(0.18)
        yield b"event: a\n\n"
        await asyncio.sleep(0.13)
        yield b"event: b\n\n"

    sent = await _answer_of(slow())
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    bodies = _bodies(sent)
    a, b = bodies.index(b"event: a\n\n"), bodies.index(b"event: b\n\n")
    assert a >= 2 and set(bodies[:a]) == {PING_FRAME}, bodies  # from the start, before any frame
    assert b - a >= 2 and set(bodies[a + 1 : b]) == {PING_FRAME}, bodies
    assert bodies[b + 1 :] == [b""], bodies  # none after the last frame

    async def quick() -> AsyncIterator[bytes]:
        for kind in "abc":
            yield f"event: {kind}\n\n".encode()

    assert _bodies(await _answer_of(quick())) == [b"event: a\n\n", b"event: b\n\n", b"event: c\n\n", b""]


async def test_a_refusal_after_a_ping_ends_the_stream_with_an_error_event() -> None:
    """A refusal (the engine process's full queue) is a 529 answer while nothing was sent, and an
    ``error`` event (overloaded_error) once a keep-alive sent the status line."""

    async def refused(after: float) -> AsyncIterator[bytes]:
        await asyncio.sleep(after)
        raise overloaded("Server is overloaded: full.")
        yield b""  # an async generator

    sent = await _answer_of(refused(0.13))
    assert sent[0]["status"] == 200
    bodies = _bodies(sent)
    assert len(bodies) >= 3 and set(bodies[:-1]) == {PING_FRAME}, bodies
    error = {"type": "error", "error": {"type": "overloaded_error", "message": "Server is overloaded: full."}}
    assert bodies[-1] == f"event: error\ndata: {json.dumps(error)}\n\n".encode()

    start, body = await _answer_of(refused(0.0), interval=1.0)
    assert start["status"] == 529 and (b"retry-after", b"1") in start["headers"]
    assert json.loads(body["body"]) == {**error, "request_id": "r1"} and not body.get("more_body")
