"""Request fields of ``POST /v1/responses`` that are honoured or refused, never ignored, with the
official SDK against a replica started with ``--enable-auto-tool-choice --tool-call-parser hermes``:
vLLM's ``structured_outputs`` extra constrains the text as on the chat endpoint; ``max_tool_calls``
keeps the first calls of an answer; ``conversation`` (OpenAI's Conversations API) is a 400; a
function whose ``parameters`` is not an object schema is a 400 here and on chat."""

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


@pytest.mark.parametrize("stream", [False, True])
def test_max_tool_calls_keeps_the_first_calls(sdk, hermes_server, stream) -> None:
    steer = {"structured_outputs": {"regex": THREE_CALLS}}
    whole = _respond(sdk, hermes_server, stream, tools=TOOLS, extra_body=steer)
    assert [(c.name, c.arguments) for c in whole.output] == EXPECTED  # the steer works: three calls
    assert whole.max_tool_calls is None
    for cap in (2, 1):
        r = _respond(sdk, hermes_server, stream, tools=TOOLS, max_tool_calls=cap, extra_body=steer)
        assert [(c.type, c.name, c.arguments) for c in r.output] == [
            ("function_call", n, a) for n, a in EXPECTED[:cap]
        ]
        assert r.status == "completed" and r.max_tool_calls == cap
        assert len({c.call_id for c in r.output}) == cap


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
