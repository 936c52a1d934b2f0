"""Tool calling (and reasoning) over HTTP with the official openai SDK, against a replica started
with ``--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3``: named and ``required`` calls constrained
to the tools' schemas (any model), ``auto`` calls read back from the model's own format (the
random test model is steered into it with a regex), streamed and not, with exact agreement between
the two; multi-turn histories; every misuse a 400."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel

from engine.tokenizer import Tokenizer

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "unit": {"enum": ["C", "F"]},
        "days": {"type": "boolean"},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {
            "name": "now",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    },
]
# An object schema whose property names a type that does not exist: a 400 where it compiles.
NOPE_PROPERTY = {"type": "object", "properties": {"a": {"type": "nope"}}, "required": ["a"]}
HERMES_NOW = r'<tool_call>\{"name": "now", "arguments": \{\}\}</tool_call>'


@pytest.fixture(scope="module")
def tool_server(server_process, tiny_llama: Path, serve_logs: Path):
    srv = server_process(
        tiny_llama,
        [
            *("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"),
            *("--num-kv-blocks", "256"),
        ],
        serve_logs,
    ).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(tool_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tool_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _create(client, tool_server, **kw):
    return client.chat.completions.create(
        model=tool_server.model_name, messages=kw.pop("messages", MESSAGES), **kw
    )


def _streamed(client, tool_server, **kw) -> tuple[str, list[tuple[str, str, str]], str]:
    """(content, [(id, name, arguments)], finish_reason) accumulated from a stream as SDKs do."""
    content, calls, finish = "", {}, None
    for chunk in _create(client, tool_server, stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, ["", "", ""])
                call[0] += d.id or ""
                call[1] += (d.function.name or "") if d.function else ""
                call[2] += (d.function.arguments or "") if d.function else ""
            finish = c.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


def _check_weather(arguments: str) -> None:
    args = json.loads(arguments)
    assert list(args) == ["city", "unit", "days"]
    assert (
        args["city"] in ("Paris", "Oslo", "Lima")
        and args["unit"] in ("C", "F")
        and isinstance(args["days"], bool)
    )


def test_named_function(client, tool_server) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = _create(client, tool_server, tools=TOOLS, tool_choice=choice, max_tokens=60, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    _check_weather(call.function.arguments)
    content, calls, finish = _streamed(
        client, tool_server, tools=TOOLS, tool_choice=choice, max_tokens=60, temperature=0
    )
    assert content == "" and finish == "stop"
    ((cid, name, arguments),) = calls
    assert cid.startswith("call_") and name == "get_weather"
    assert arguments == call.function.arguments  # greedy: the stream carries the same arguments


@pytest.mark.parametrize("parallel", [True, False])
def test_required(client, tool_server, parallel, tiny_llama) -> None:
    # A random model may go on adding calls to the array until max_tokens: "]" is made likelier
    # (the grammar still decides where it may go).
    close = Tokenizer.from_dir(tiny_llama).encode("]", add_special_tokens=False)
    assert len(close) == 1
    kw = dict(
        logit_bias={str(close[0]): 5.0},
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=parallel,
        max_tokens=120,
        temperature=1.0,
        seed=3,
    )
    r = _create(client, tool_server, n=2, **kw)
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None
        assert 1 <= len(c.message.tool_calls) <= (8 if parallel else 1)
        for call in c.message.tool_calls:
            if call.function.name == "get_weather":
                _check_weather(call.function.arguments)
            else:
                assert (call.function.name, call.function.arguments) == ("now", "{}")
    content, calls, finish = _streamed(client, tool_server, **kw)
    first = r.choices[0].message.tool_calls
    assert content == "" and finish == "tool_calls"
    assert [(n, a) for _, n, a in calls] == [(c.function.name, c.function.arguments) for c in first]


def test_auto_reads_the_models_own_format(client, tool_server) -> None:
    # The random model is steered into Hermes's format with a regex; the parser reads it back.
    steer = {"guided_regex": r"Sure, checking\. " + HERMES_NOW}
    r = _create(client, tool_server, tools=TOOLS, max_tokens=150, temperature=0, extra_body=steer)
    c = r.choices[0]
    # The text before the call, as written (vLLM's Hermes parser keeps it unstripped), and the
    # same whole or streamed.
    assert c.finish_reason == "tool_calls" and c.message.content == "Sure, checking. "
    assert [(t.function.name, t.function.arguments) for t in c.message.tool_calls] == [("now", "{}")]
    content, calls, finish = _streamed(
        client, tool_server, tools=TOOLS, max_tokens=150, temperature=0, extra_body=steer
    )
    assert content == "Sure, checking. " and finish == "tool_calls"
    assert [(n, a) for _, n, a in calls] == [("now", "{}")]


@pytest.mark.parametrize("parallel", [True, False])
def test_auto_keeps_only_the_first_call_unless_parallel(client, tool_server, parallel) -> None:
    # The model writes two calls; parallel_tool_calls false keeps the first (vLLM's filter), whole
    # and streamed.
    two = (
        HERMES_NOW
        + r"\n"
        + HERMES_NOW.replace("now", "get_weather").replace(
            r"\{\}\}", r'\{"city": "Oslo", "unit": "C", "days": false\}\}'
        )
    )
    kw = dict(
        tools=TOOLS,
        max_tokens=150,
        temperature=0,
        parallel_tool_calls=parallel,
        extra_body={"guided_regex": two},
    )
    r = _create(client, tool_server, **kw)
    whole = [(t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls]
    content, calls, finish = _streamed(client, tool_server, **kw)
    expected = [("now", "{}"), ("get_weather", '{"city": "Oslo", "unit": "C", "days": false}')]
    assert whole == [(n, a) for _, n, a in calls] == (expected if parallel else expected[:1])
    assert r.choices[0].finish_reason == finish == "tool_calls"


def test_auto_without_a_call_is_text(client, tool_server) -> None:
    r = _create(
        client,
        tool_server,
        tools=TOOLS,
        max_tokens=40,
        temperature=0,
        extra_body={"guided_regex": "No tools needed"},
    )
    c = r.choices[0]
    assert (c.message.content, c.message.tool_calls, c.finish_reason) == ("No tools needed", None, "stop")


def test_multi_turn_history_with_calls_and_results(client, tool_server) -> None:
    first = _create(
        client,
        tool_server,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=0,
    )
    calls = first.choices[0].message.tool_calls
    history = [
        *MESSAGES,
        first.choices[0].message.model_dump(exclude_none=True),
        *({"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'} for call in calls),
    ]
    r = _create(
        client, tool_server, messages=history, tools=TOOLS, tool_choice="none", max_tokens=4, temperature=0
    )
    assert r.choices[0].message.tool_calls is None and r.usage.completion_tokens >= 1
    assert r.usage.prompt_tokens > first.usage.prompt_tokens


class GetWeather(BaseModel):
    city: Literal["Paris", "Oslo"]
    unit: Literal["C", "F"]


def test_sdk_parse_with_a_pydantic_tool(client, tool_server) -> None:
    r = client.chat.completions.parse(
        model=tool_server.model_name,
        messages=MESSAGES,
        tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice={"type": "function", "function": {"name": "GetWeather"}},
        max_tokens=40,
        temperature=0,
    )
    (call,) = r.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, GetWeather)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"description": "x"}}], "tool_choice": "required"},
            "tools.0.function.name",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": NOPE_PROPERTY}}],
                "tool_choice": "required",
            },
            "tools",
        ),
        (  # not an object schema: refused as it is read (test_responses_fields.py)
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
            "tools.0.function.parameters",
        ),
        ({"tool_choice": "auto"}, "tool_choice"),
    ],
)
def test_misuse_is_a_400(tool_server, body, param) -> None:
    for stream in (False, True):
        r = httpx.post(
            tool_server.url + "/v1/chat/completions",
            json={"messages": MESSAGES, "max_tokens": 4, "stream": stream, **body},
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param


def test_auto_needs_a_parser(server) -> None:
    # The default replica has no --tool-call-parser: "auto" (tools without tool_choice) is refused, as vLLM does.
    r = httpx.post(
        server.url + "/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS, "max_tokens": 4}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={
            "messages": MESSAGES,
            "tools": TOOLS,
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "max_tokens": 120,
            "temperature": 0,
        },
    )
    assert r.status_code == 200 and r.json()["choices"][0]["message"].get("tool_calls"), r.text


def _stream_parts(client, tool_server, **kw) -> tuple[str, str, list[tuple[str, str]]]:
    reasoning, content, calls = "", "", []
    for chunk in _create(client, tool_server, stream=True, **kw):
        for c in chunk.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            content += c.delta.content or ""
            calls += [(d.function.name, d.function.arguments) for d in c.delta.tool_calls or []]
    return reasoning, content, calls


def test_reasoning_is_split_from_the_answer(client, tool_server) -> None:
    steer = {"guided_regex": r"<think>Check the map\.</think>\n\nParis is sunny\."}
    r = _create(client, tool_server, max_tokens=150, temperature=0, extra_body=steer)
    message = r.choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == (
        "Check the map.",
        "Paris is sunny.",
    )
    assert _stream_parts(client, tool_server, max_tokens=150, temperature=0, extra_body=steer) == (
        "Check the map.",
        "Paris is sunny.",
        [],
    )
    # Without thinking (qwen3: no opening <think>) the answer is all content, no reasoning field.
    r = _create(client, tool_server, max_tokens=40, temperature=0, extra_body={"guided_regex": "Paris"})
    assert r.choices[0].message.content == "Paris" and "reasoning_content" not in (
        r.choices[0].message.model_extra or {}
    )


def test_reasoning_then_a_tool_call(client, tool_server) -> None:
    steer = {"guided_regex": r"<think>Need the time\.</think>" + HERMES_NOW}
    r = _create(client, tool_server, tools=TOOLS, max_tokens=150, temperature=0, extra_body=steer)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert c.message.model_extra["reasoning_content"] == "Need the time."
    assert [(t.function.name, t.function.arguments) for t in c.message.tool_calls] == [("now", "{}")]
    assert _stream_parts(
        client, tool_server, tools=TOOLS, max_tokens=150, temperature=0, extra_body=steer
    ) == (
        "Need the time.",
        "",
        [("now", "{}")],
    )
