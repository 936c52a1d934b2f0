"""Request fields of ``POST /v1/responses`` that are honoured or refused, never ignored, with the
official SDK against a replica started with ``--enable-auto-tool-choice --tool-call-parser hermes``:
vLLM's ``structured_outputs`` extra constrains the text as on the chat endpoint; ``max_tool_calls``
keeps the first calls of an answer and stops it there; ``tool_choice`` ``allowed_tools`` offers only
the tools it names; ``conversation`` (OpenAI's Conversations API) and ``prompt`` (stored prompts) are
a 400; a function whose ``parameters`` is not an object schema is a 400 here and on chat."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

TOOLS = [
    {
        "type": "function",
        "name": "now",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
    {
        "type": "function",
        "name": "city",
        "parameters": {"type": "object", "properties": {"name": {"enum": ["Oslo", "Lima"]}}},
    },
]
NOW = r'<tool_call>\{"name": "now", "arguments": \{\}\}</tool_call>'
OSLO = r'<tool_call>\{"name": "city", "arguments": \{"name": "Oslo"\}\}</tool_call>'
# The random model is steered into writing three Hermes calls (structured_outputs' regex), which the
# server's tool-call parser reads back.
THREE_CALLS = NOW + r"\n" + OSLO + r"\n" + NOW
EXPECTED = [("now", "{}"), ("city", '{"name": "Oslo"}'), ("now", "{}")]


@pytest.fixture(scope="module")
def hermes_server(server_process, tiny_llama: Path, serve_logs: Path):
    srv = server_process(
        tiny_llama, ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"], serve_logs
    ).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def sdk(hermes_server):  # noqa: ANN201
    return openai.OpenAI(base_url=hermes_server.url + "/v1", api_key="x", max_retries=0)


def _respond(sdk, server, stream: bool, **kw):  # noqa: ANN202
    kw = dict(model=server.model_name, input="Go", max_output_tokens=400, temperature=0, **kw)
    if not stream:
        return sdk.responses.create(**kw)
    with sdk.responses.stream(**kw) as s:
        return s.get_final_response()


@pytest.mark.parametrize("stream", [False, True])
def test_structured_outputs_constrain_the_text(sdk, hermes_server, stream) -> None:
    r = _respond(sdk, hermes_server, stream, extra_body={"structured_outputs": {"regex": "Fine, thanks"}})
    assert r.output_text == "Fine, thanks"
    r = _respond(sdk, hermes_server, stream, extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert r.output_text in ("left", "right")


def _tokens_through_call(sdk, server, tokenizer, steer: dict) -> list[int]:
    """How many output tokens the steered answer has when its 1st, 2nd, ... call is complete (its
    ``</tool_call>`` written), and in all: read from the same answer on the chat endpoint (the same
    prompt: "Go" as a user message, the same tools) with its token ids."""
    chat_tools = [
        {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS
    ]
    r = sdk.chat.completions.create(
        model=server.model_name,
        messages=[{"role": "user", "content": "Go"}],
        tools=chat_tools,
        max_tokens=400,
        temperature=0,
        extra_body={**steer, "return_token_ids": True},
    )
    ids = r.choices[0].token_ids
    ends = [
        k
        for k in range(1, len(ids) + 1)
        if tokenizer.decode(ids[:k]).count("</tool_call>")
        > (tokenizer.decode(ids[: k - 1]).count("</tool_call>"))
    ]
    return [*ends, len(ids)]


@pytest.mark.parametrize("stream", [False, True])
def test_max_tool_calls_stops_the_answer_at_the_cap(sdk, hermes_server, tokenizer, scrape, stream) -> None:
    """The answer keeps its first calls and ends with the last one allowed: the model writes no
    token past it, so usage counts fewer tokens, and the stored response is the one returned. The
    engine request it ends is counted as a stop, not as a client's abort."""

    def ends(reason: str) -> float:
        labels = {"model_name": hermes_server.model_name, "finished_reason": reason}
        return scrape(hermes_server.url, "vllm:request_success_total", **labels) or 0.0

    steer = {"structured_outputs": {"regex": THREE_CALLS}}
    *through, total = _tokens_through_call(sdk, hermes_server, tokenizer, steer)
    assert len(through) == 3 and through[-1] < total  # the steer: three calls, then more tokens
    whole = _respond(sdk, hermes_server, stream, tools=TOOLS, extra_body=steer)
    assert [(c.name, c.arguments) for c in whole.output] == EXPECTED  # the steer works: three calls
    assert whole.max_tool_calls is None and whole.usage.output_tokens == total
    stops, aborts = ends("stop"), ends("abort")
    for cap in (2, 1):
        r = _respond(sdk, hermes_server, stream, tools=TOOLS, max_tool_calls=cap, extra_body=steer)
        assert [(c.type, c.name, c.arguments, c.status) for c in r.output] == [
            ("function_call", n, a, "completed") for n, a in EXPECTED[:cap]
        ]
        assert r.status == "completed" and r.max_tool_calls == cap
        assert len({c.call_id for c in r.output}) == cap
        assert r.usage.output_tokens == through[cap - 1] < total
        assert r.usage.total_tokens == r.usage.input_tokens + through[cap - 1]
        stored = sdk.responses.retrieve(r.id)
        fields = [(c.id, c.call_id, c.name, c.arguments, c.status) for c in r.output]
        assert [(c.id, c.call_id, c.name, c.arguments, c.status) for c in stored.output] == fields
        assert stored.usage == r.usage and stored.status == "completed"
    assert (ends("stop"), ends("abort")) == (stops + 2, aborts)


def test_max_tool_calls_zero_stops_at_the_first_call(sdk, hermes_server, tokenizer) -> None:
    """A cap of 0 with ``auto``: the call the model writes is dropped and the answer ends there."""
    steer = {"structured_outputs": {"regex": "Sure" + r"\n" + THREE_CALLS}}
    first, *_ = _tokens_through_call(sdk, hermes_server, tokenizer, steer)
    for stream in (False, True):
        r = _respond(sdk, hermes_server, stream, tools=TOOLS, max_tool_calls=0, extra_body=steer)
        assert [(i.type, i.content[0].text) for i in r.output] == [("message", "Sure\n")]
        assert r.status == "completed" and r.usage.output_tokens == first


def test_max_tool_calls_caps_a_required_answer(sdk, hermes_server) -> None:
    """``required`` answers are one JSON array: the cap is its ``maxItems``, so the grammar ends the
    answer after the last call allowed (the random model, unsteered, writes as many as it may)."""
    for stream in (False, True):
        r = _respond(sdk, hermes_server, stream, tools=TOOLS, tool_choice="required", max_tool_calls=2)
        assert r.status == "completed" and 1 <= len(r.output) <= 2
        assert {i.type for i in r.output} == {"function_call"}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"conversation": "conv_123"}, "conversation"),
        ({"conversation": {"id": "conv_123"}}, "conversation"),
        (
            {"structured_outputs": {"regex": "a"}, "text": {"format": {"type": "json_object"}}},
            "structured_outputs",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"prompt": {"id": "pmpt_1", "variables": {"city": "Oslo"}}}, "prompt"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "mode": "none", "tools": []}},
            "tool_choice",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}},
            "tool_choice",
        ),
        (
            {
                "tools": TOOLS,
                "tool_choice": {
                    "type": "allowed_tools",
                    "mode": "auto",
                    "tools": [{"type": "function", "name": "x"}],
                },
            },
            "tool_choice",
        ),
        (
            {
                "tools": TOOLS,
                "tool_choice": {"type": "allowed_tools", "mode": "required", "tools": [{"type": "mcp"}]},
            },
            "tool_choice",
        ),
        ({"truncation": "middle"}, "truncation"),
        ({"max_tool_calls": -1}, "max_tool_calls"),
        ({"max_tool_calls": 0, "tools": TOOLS, "tool_choice": "required"}, "max_tool_calls"),
        (
            {"max_tool_calls": 0, "tools": TOOLS, "tool_choice": {"type": "function", "name": "now"}},
            "max_tool_calls",
        ),
        (
            {
                "tools": [{"type": "function", "name": "say", "parameters": {"type": "string"}}],
                "tool_choice": {"type": "function", "name": "say"},
            },
            "tools",
        ),
    ],
)
def test_fields_it_cannot_honour_are_a_400(hermes_server, body, param) -> None:
    for stream in (False, True):
        r = httpx.post(
            hermes_server.url + "/v1/responses", json={"input": "x", "stream": stream, **body}, timeout=60
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("stream", [False, True])
def test_allowed_tools_offer_only_the_tools_they_name(sdk, hermes_server, stream) -> None:
    """``tool_choice`` ``allowed_tools`` (OpenAI SDK users send it to narrow a large tool list): a
    ``required`` answer calls one of the allowed tools only, however the tools list is ordered."""
    for name in ("now", "city"):  # the same greedy model calls each when it is the one allowed
        allowed = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": name}]}
        r = _respond(sdk, hermes_server, stream, tools=TOOLS, tool_choice=allowed, max_tool_calls=1)
        assert [(i.type, i.name) for i in r.output] == [("function_call", name)]
        assert r.tool_choice.type == "allowed_tools" and [t.name for t in r.tools] == ["now", "city"]
    # mode auto: a model that writes a call to an allowed tool makes it, as with tool_choice auto
    steer = {"structured_outputs": {"regex": OSLO}}
    auto = {**allowed, "mode": "auto"}
    r = _respond(sdk, hermes_server, stream, tools=TOOLS, tool_choice=auto, extra_body=steer)
    assert [(i.type, i.name, i.arguments) for i in r.output] == [
        ("function_call", "city", '{"name": "Oslo"}')
    ]


def test_truncation_auto_drops_the_oldest_turns(sdk, hermes_server) -> None:
    """``truncation: auto`` (OpenAI's: drop items from the beginning of a conversation that exceeds
    the context) answers what fits: here the last turn, as if sent alone; ``disabled`` (the default)
    is OpenAI's 400. The stored conversation stays whole."""
    long = " ".join(f"item {i}" for i in range(600))
    turns = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": long},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": "Go"},
    ]
    kw = dict(model=hermes_server.model_name, instructions="Answer.", max_output_tokens=300, temperature=0)
    with pytest.raises(openai.BadRequestError) as e:
        sdk.responses.create(input=turns, **kw)
    assert e.value.body["code"] == "context_length_exceeded"
    r = sdk.responses.create(input=turns, truncation="auto", **kw)
    alone = sdk.responses.create(input=[turns[0], turns[3]], **kw)
    assert r.truncation == "auto" and alone.truncation == "disabled"
    assert r.usage.input_tokens == alone.usage.input_tokens and r.output_text == alone.output_text
    stored = sdk.responses.input_items.list(r.id, order="asc")
    assert [i.content[0].text for i in stored.data] == ["Be brief.", long, "Noted.", "Go"]
    with pytest.raises(openai.BadRequestError) as e:  # nothing left to drop: still the 400
        sdk.responses.create(input=[{"role": "user", "content": long}], truncation="auto", **kw)
    assert e.value.body["code"] == "context_length_exceeded"


def test_conversation_through_the_sdk_names_previous_response_id(sdk, hermes_server) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        sdk.responses.create(model=hermes_server.model_name, input="x", conversation="conv_1")
    assert e.value.body["param"] == "conversation"
    assert "previous_response_id" in e.value.body["message"]


@pytest.mark.parametrize("kind", ["string", "array", ["string", "null"]])
def test_chat_refuses_a_function_whose_parameters_are_not_an_object(sdk, hermes_server, kind) -> None:
    tools = [{"type": "function", "function": {"name": "say", "parameters": {"type": kind}}}]
    for choice in ({"type": "function", "function": {"name": "say"}}, "required", "auto"):
        with pytest.raises(openai.BadRequestError) as e:
            sdk.chat.completions.create(
                model=hermes_server.model_name,
                messages=[{"role": "user", "content": "x"}],
                tools=tools,
                tool_choice=choice,
                max_tokens=5,
            )
        assert e.value.body["param"] == "tools.0.function.parameters"
        assert "type 'object'" in e.value.body["message"]


def test_a_schema_that_names_no_type_is_accepted(sdk, hermes_server) -> None:
    tools = [{"type": "function", "name": "f", "parameters": {"properties": {"n": {"enum": [1, 2]}}}}]
    r = sdk.responses.create(
        model=hermes_server.model_name, input="x", tools=tools, tool_choice="none", max_output_tokens=5
    )
    assert r.status in ("completed", "incomplete") and r.tools[0].name == "f"
