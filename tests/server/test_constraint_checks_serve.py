"""Over HTTP, a constraint its grammar would half apply, or that no output satisfies, is a 400
naming the field that carried it, before any stream starts, on every API that takes one: chat
(``response_format``, ``structured_outputs``, ``guided_json``, ``tools``), completions, Responses
(``text.format``, ``tools``) and Anthropic Messages (``tools``, in its own error shape). The
server keeps serving."""

from __future__ import annotations

import httpx
import pytest

TAGS = {
    "type": "object",
    "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
    "required": ["tags"],
}
REFUSAL = (
    "structured outputs json uses the JSON Schema keyword 'uniqueItems' at #/properties/tags, "
    "which structured outputs cannot enforce"
)
EVEN = {"type": "integer", "multipleOf": 2, "minimum": 0}
EVEN_REFUSAL = (
    "structured outputs json uses the JSON Schema keyword 'multipleOf' with a lower or an upper bound "
    "alone, which structured outputs cannot enforce"
)
MESSAGES = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "tag", "parameters": TAGS}}
IN_REQUIRED = "at #/items/anyOf/0/properties/parameters/properties/tags"


def _error(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    return r.json()["error"]


@pytest.mark.parametrize(
    ("path", "extra", "param", "message"),
    [
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": TAGS}}},
            "response_format",
            REFUSAL,
        ),
        ("/v1/chat/completions", {"structured_outputs": {"json": EVEN}}, "structured_outputs", EVEN_REFUSAL),
        ("/v1/chat/completions", {"guided_json": TAGS}, "guided_json", REFUSAL),
        (
            "/v1/chat/completions",
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "tag"}}},
            "tools",
            REFUSAL,
        ),
        (
            "/v1/chat/completions",
            {"tools": [TOOL], "tool_choice": "required"},
            "tools",
            REFUSAL.replace("at #/properties/tags", IN_REQUIRED),
        ),
        ("/v1/completions", {"guided_json": EVEN}, "guided_json", EVEN_REFUSAL),
        (
            "/v1/chat/completions",
            {"structured_outputs": {"grammar": "root ::= root"}},
            "structured_outputs",
            "invalid structured outputs grammar: no output of this model can satisfy it",
        ),
        (
            "/v1/completions",
            {"structured_outputs": {"regex": r"[^\s\S]"}},
            "structured_outputs",
            "invalid structured outputs regex: no output of this model can satisfy it",
        ),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_refused_before_any_stream(server, path, extra, param, message, stream) -> None:
    prompt = {"messages": MESSAGES} if path.endswith("chat/completions") else {"prompt": "hi"}
    body = {"model": server.model_name, **prompt, "max_tokens": 5, "stream": stream, **extra}
    r = httpx.post(server.url + path, json=body, timeout=60)
    error = _error(r)
    assert (error["param"], error["message"], error["code"]) == (param, message, "invalid_value")


def test_responses_name_text_format_and_tools(server) -> None:
    base = {"model": server.model_name, "input": "hi", "max_output_tokens": 5}
    fmt = {"format": {"type": "json_schema", "name": "t", "schema": TAGS}}
    error = _error(httpx.post(server.url + "/v1/responses", json={**base, "text": fmt}, timeout=60))
    assert (error["param"], error["message"]) == ("text.format", REFUSAL)
    tool = {"type": "function", "name": "tag", "parameters": TAGS}
    body = {**base, "tools": [tool], "tool_choice": "required", "stream": True}
    error = _error(httpx.post(server.url + "/v1/responses", json=body, timeout=60))
    assert (error["param"], error["message"]) == (
        "tools",
        REFUSAL.replace("at #/properties/tags", IN_REQUIRED),
    )


def test_messages_refuse_in_anthropics_shape(server) -> None:
    body = {
        "model": server.model_name,
        "max_tokens": 5,
        "messages": MESSAGES,
        "tools": [{"name": "tag", "input_schema": TAGS}],
        "tool_choice": {"type": "tool", "name": "tag"},
    }
    r = httpx.post(server.url + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 400
    error = {"type": "invalid_request_error", "message": REFUSAL}
    assert r.json() == {"type": "error", "error": error, "request_id": r.headers["request-id"]}


def test_enforced_schemas_still_serve(server) -> None:
    schema = {
        **TAGS,
        "properties": {"tags": {**TAGS["properties"]["tags"], "uniqueItems": False, "maxItems": 0}},
    }
    body = {
        "model": server.model_name,
        "messages": MESSAGES,
        "max_tokens": 20,
        "temperature": 0,
        "structured_outputs": {"json": schema, "disable_any_whitespace": True},
    }
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == ('{"tags": []}', "stop")
