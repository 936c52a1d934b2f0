"""OpenAI's Responses API (``POST /v1/responses``) with the official SDK: text, streamed events,
function calls, multi-turn input items, structured text via ``responses.parse``; answers equal
the chat endpoint's for the same request; what it cannot honour is a 400. Stored responses and
``previous_response_id``: test_responses_store.py."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import httpx
import pytest
from pydantic import BaseModel

from engine.tokenizer import Tokenizer

TOOLS = [
    {
        "type": "function",
        "name": "now",
        "description": "The time",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"enum": ["UTC", "CET"]}},
            "required": ["tz"],
            "additionalProperties": False,
        },
    }
]


def test_text_equals_the_chat_answer(client, server) -> None:
    r = client.responses.create(
        model=server.model_name,
        input="Hello there",
        instructions="Be terse.",
        max_output_tokens=12,
        temperature=0,
    )
    chat = client.chat.completions.create(
        model=server.model_name,
        messages=[{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hello there"}],
        max_tokens=12,
        temperature=0,
    )
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == chat.choices[0].message.content
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert (
        r.usage.input_tokens == chat.usage.prompt_tokens
        and r.usage.output_tokens == chat.usage.completion_tokens
    )
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if chat.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed"


def test_streamed_events(client, server) -> None:
    kw = dict(
        model=server.model_name,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
        max_output_tokens=10,
        temperature=0,
    )
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{whole.status}",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_function_calls(client, server, stream) -> None:
    kw = dict(
        model=server.model_name, input="What time is it?", tools=TOOLS, max_output_tokens=60, temperature=0
    )
    if stream:
        with client.responses.stream(tool_choice={"type": "function", "name": "now"}, **kw) as s:
            r = s.get_final_response()
    else:
        r = client.responses.create(tool_choice="required", parallel_tool_calls=False, **kw)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "now" and call.call_id.startswith("call_")
    assert call.arguments in ('{"tz": "UTC"}', '{"tz": "CET"}')
    assert r.status == "completed"


def test_multi_turn_input_items(client, server) -> None:
    first = client.responses.create(
        model=server.model_name,
        input="What time is it?",
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=60,
        temperature=0,
    )
    (call,) = first.output
    history = [
        {"role": "user", "content": "What time is it?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "12:00"},
    ]
    r = client.responses.create(
        model=server.model_name,
        input=history,
        tools=TOOLS,
        tool_choice="none",
        max_output_tokens=4,
        temperature=0,
    )
    assert r.output[0].type == "message" and r.usage.input_tokens > first.usage.input_tokens
    # The same turn as a continuation of the stored first response: the same prompt and answer.
    chained = client.responses.create(
        model=server.model_name,
        previous_response_id=first.id,
        input=history[2:],
        tools=TOOLS,
        tool_choice="none",
        max_output_tokens=4,
        temperature=0,
    )
    assert chained.output_text == r.output_text and chained.usage.input_tokens == r.usage.input_tokens


class Pick(BaseModel):
    ok: bool
    color: Literal["red", "green"]


def test_parse_structured_text(client, server, tiny_llama: Path) -> None:
    tok = Tokenizer.from_dir(tiny_llama)
    no_ws = {
        str(t): -100.0
        for t in range(tok.vocab_size)
        if t not in tok.all_special_ids and (b := tok.token_bytes(t)) and not b.strip()
    }
    r = client.responses.parse(
        model=server.model_name,
        input="Pick",
        text_format=Pick,
        max_output_tokens=80,
        temperature=0,
        extra_body={"logit_bias": no_ws},
    )
    assert isinstance(r.output_parsed, Pick)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content",
        ),
        ({"input": [{"type": "computer_call"}]}, "input"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({}, "input"),
        ({"input": []}, "input"),  # no message: named as the Responses field, not chat's "messages"
        ({"input": "x", "top_k": "many"}, "top_k"),
        ({"input": "x", "include": ["message.output_text.everything"]}, "include"),
        ({"input": "x", "top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_what_it_cannot_honour_is_a_400(server, body, param) -> None:
    for stream in (False, True):
        r = httpx.post(server.url + "/v1/responses", json={**body, "stream": stream}, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"return_token_ids": True}, "return_token_ids"), ({"resume": {"created_at": 1}}, "resume")],
)
def test_the_routers_fields_are_for_foreground_streams(server, extra, param) -> None:
    """What a router sends to resume a stream (``server/responses_stream.py``): nothing else takes it."""
    for mode in ({"stream": False}, {"stream": True, "background": True}):
        r = httpx.post(server.url + "/v1/responses", json={"input": "x", **mode, **extra}, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param


def test_the_routers_keys_count_this_replicas_prompt(client, server, tiny_llama: Path) -> None:
    from router.prompt_keys import TokenKeyer

    body = {
        "instructions": "Answer in one word.",
        "input": [
            {"role": "user", "content": "What time is it?"},
            {"type": "function_call", "call_id": "c1", "name": "now", "arguments": '{"tz": "UTC"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "12:00"},
        ],
        "tools": TOOLS,
        "tool_choice": "none",
    }
    r = client.responses.create(model=server.model_name, max_output_tokens=1, **body)
    _, tokens = TokenKeyer.from_dir(str(tiny_llama), 16).keys("/v1/responses", body)
    assert r.usage.input_tokens == tokens


def test_logprobs_when_included_equal_the_chat_answers(client, server) -> None:
    kw = dict(model=server.model_name, input="Hello there", max_output_tokens=6, temperature=0)
    r = client.responses.create(include=["message.output_text.logprobs"], top_logprobs=2, **kw)
    chat = client.chat.completions.create(
        model=server.model_name,
        messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    want = [t.model_dump() for t in chat.choices[0].logprobs.content]
    (part,) = r.output[0].content
    got = [lp.model_dump() for lp in part.logprobs]
    # The same tokens and alternatives; values equal up to the last float bits (a prefix-cache hit
    # computes the prompt in another batch shape).
    assert _shape(got) == _shape(want) and len(got) == r.usage.output_tokens == 6
    assert _values(got) == pytest.approx(_values(want), abs=1e-5)
    assert all(len(lp["top_logprobs"]) == 2 and isinstance(lp["bytes"], list) for lp in got)
    assert r.top_logprobs == 2
    # Streamed: each text delta carries its tokens' logprobs; the done events carry them all.
    events = list(
        client.responses.create(stream=True, include=["message.output_text.logprobs"], top_logprobs=2, **kw)
    )
    deltas = [lp.model_dump() for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert deltas == [lp.model_dump() for lp in done.logprobs]
    assert [lp.model_dump() for lp in events[-1].response.output[0].content[0].logprobs] == deltas
    assert _shape(deltas) == _shape(want) and _values(deltas) == pytest.approx(_values(want), abs=1e-5)
    # Not included (top_logprobs alone, as with OpenAI): none.
    plain = client.responses.create(top_logprobs=2, **kw)
    assert plain.output[0].content[0].logprobs == [] and plain.output_text == r.output_text
    events = list(client.responses.create(stream=True, **kw))
    assert all(e.logprobs == [] for e in events if e.type == "response.output_text.delta")


def _shape(logprobs: list[dict]) -> list:
    return [
        (lp["token"], lp["bytes"], [(t["token"], t["bytes"]) for t in lp["top_logprobs"]]) for lp in logprobs
    ]


def _values(logprobs: list[dict]) -> list[float]:
    return [v for lp in logprobs for v in (lp["logprob"], *(t["logprob"] for t in lp["top_logprobs"]))]
