"""The Responses API (``POST /v1/responses``) with input items as OpenAI's clients send them back,
and the output items of a cut-off answer:

* a ``function_call_output``'s ``output`` may be a list of ``input_text`` parts (the same prompt as
  their text as a string); another part is a 400 naming it;
* the text a model wrote before its calls (a ``message`` item, then ``function_call`` items) is one
  assistant turn, as it was generated: the prompt a chat request with that turn renders;
* an output message's ``refusal`` part sent back is what the assistant said;
* a function tool without a name, or with parameters that are not an object, is a 400 naming
  ``tools[i]`` as the client wrote it (not the chat request's ``tools.0.function.name``);
* the item a response cut off by ``max_output_tokens`` ends in is ``incomplete`` (whole, streamed
  and stored alike), as OpenAI marks it; a whole answer's items are ``completed``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.conftest import ServerProcess
from tests.server.test_messages_api import TEMPLATE

TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 5}},
            "required": ["city"],
            "additionalProperties": False,
        },
    }
]
CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'}


@pytest.fixture(scope="module")
def srv(
    tiny_llama: Path, serve_logs: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    template = tmp_path_factory.mktemp("template") / "tools.jinja"
    template.write_text(TEMPLATE)  # renders assistant turns, their tool calls and tool results
    server = ServerProcess(tiny_llama, ["--chat-template", str(template)], serve_logs).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)


def _input_tokens(srv: ServerProcess, items: list[dict]) -> int:
    body = {"model": srv.model_name, "input": items, "max_output_tokens": 1, "store": False}
    r = httpx.post(srv.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["input_tokens"]


def _chat_tokens(srv: ServerProcess, messages: list[dict]) -> int:
    r = httpx.post(srv.url + "/tokenize", json={"model": srv.model_name, "messages": messages}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["count"]


def test_a_function_call_output_of_text_parts(srv: ServerProcess) -> None:
    def turn(output: object) -> list[dict]:
        result = {"type": "function_call_output", "call_id": "call_1", "output": output}
        return [{"role": "user", "content": "Weather in Oslo?"}, CALL, result]

    parts = [{"type": "input_text", "text": "4 C"}, {"type": "input_text", "text": ", rain"}]
    assert _input_tokens(srv, turn(parts)) == _input_tokens(srv, turn("4 C, rain"))
    image = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}
    body = {"model": srv.model_name, "input": turn([parts[0], image]), "max_output_tokens": 1}
    r = httpx.post(srv.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == (
        "input[2].output[1]: only input_text parts are supported in a function_call_output, not 'input_image'"
    )


def test_text_and_calls_of_one_turn_are_one_assistant_turn(srv: ServerProcess) -> None:
    items = [
        {"role": "user", "content": "Weather in Oslo and Bergen?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        CALL,
        {**CALL, "call_id": "call_2", "arguments": '{"city": "Bergen"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "4 C"},
        {"type": "function_call_output", "call_id": "call_2", "output": "6 C"},
    ]
    calls = [
        {"id": c, "type": "function", "function": {"name": "get_weather", "arguments": a}}
        for c, a in (("call_1", '{"city": "Oslo"}'), ("call_2", '{"city": "Bergen"}'))
    ]
    chat = [
        {"role": "user", "content": "Weather in Oslo and Bergen?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "content": "4 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "6 C"},
    ]
    assert _input_tokens(srv, items) == _chat_tokens(srv, chat)


def test_a_refusal_part_is_what_the_assistant_said(srv: ServerProcess) -> None:
    def history(part: dict) -> list[dict]:
        said = {"type": "message", "role": "assistant", "content": [part]}
        return [{"role": "user", "content": "Say something rude."}, said, {"role": "user", "content": "Why?"}]

    refused = history({"type": "refusal", "refusal": "I will not."})
    assert _input_tokens(srv, refused) == _input_tokens(
        srv, history({"type": "output_text", "text": "I will not."})
    )


def _streamed(srv: ServerProcess, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", srv.url + "/v1/responses", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
    return events


@pytest.mark.parametrize(
    ("extra", "kind"),
    [
        ({}, "message"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "get_weather"}}, "function_call"),
    ],
)
def test_the_item_a_cut_response_ends_in_is_incomplete(
    srv: ServerProcess, client: openai.OpenAI, extra: dict, kind: str
) -> None:
    body = {
        "model": srv.model_name,
        "input": "Weather in Oslo?",
        "max_output_tokens": 3,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }
    whole = httpx.post(srv.url + "/v1/responses", json=body, timeout=60).json()
    assert whole["status"] == "incomplete" and whole["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [(item["type"], item["status"]) for item in whole["output"]] == [(kind, "incomplete")]
    events = _streamed(srv, body)
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(item["type"], item["status"]) for item in done] == [(kind, "incomplete")]
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["output"] == done
    stored = client.responses.retrieve(events[-1]["response"]["id"])
    assert [item.status for item in stored.output] == ["incomplete"]


def test_a_whole_answers_items_are_completed(srv: ServerProcess) -> None:
    body = {
        "model": srv.model_name,
        "input": "Weather in Oslo?",
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_output_tokens": 60,
        "temperature": 0,
    }
    whole = httpx.post(srv.url + "/v1/responses", json=body, timeout=60).json()
    assert whole["status"] == "completed"
    assert [(item["type"], item["status"]) for item in whole["output"]] == [("function_call", "completed")]
    events = _streamed(srv, body)
    assert events[-1]["type"] == "response.completed"
    assert [item["status"] for item in events[-1]["response"]["output"]] == ["completed"]


@pytest.mark.parametrize(
    ("tool", "message"),
    [
        ({"type": "function"}, "tools[0]: a function tool needs a name"),
        ({"type": "function", "name": ""}, "tools[0]: a function tool needs a name"),
        (
            {"type": "function", "name": "f", "parameters": []},
            "tools[0].parameters must be a JSON schema object",
        ),
    ],
)
def test_a_bad_function_tool_is_named_as_the_client_wrote_it(
    srv: ServerProcess, tool: dict, message: str
) -> None:
    body = {"model": srv.model_name, "input": "hi", "tools": [tool], "tool_choice": "required"}
    r = httpx.post(srv.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["message"], r.json()["error"]["param"]) == (message, "tools")


def test_a_function_tool_without_parameters_is_taken(srv: ServerProcess) -> None:
    tool = {"type": "function", "name": "ping", "parameters": None}  # OpenAI's parameters are nullable
    body = {"model": srv.model_name, "input": "hi", "tools": [tool], "tool_choice": "required"}
    r = httpx.post(srv.url + "/v1/responses", json={**body, "max_output_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
