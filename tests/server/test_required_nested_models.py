"""``tool_choice: "required"`` with tools whose parameters use local references, as the openai SDK's
``pydantic_function_tool`` writes nested models (``$defs`` + ``"$ref": "#/$defs/Address"``): each
tool's schema sits inside the array-of-calls constraint, and its references still name its own
definitions (vLLM hoists them; here they are rebased), so the answer's calls follow the nested
schema, whole and streamed."""

from __future__ import annotations

import json

import httpx

from server.chat_protocol import ChatCompletionRequest
from server.tools import plan_tools

ADDRESS = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "zip": {"enum": ["75001", "0150"]}},
    "required": ["city", "zip"],
    "additionalProperties": False,
}
# Both tools name a definition "Address", with different schemas: each must keep its own.
SHIP = {
    "type": "object",
    "properties": {"to": {"$ref": "#/$defs/Address"}, "express": {"type": "boolean"}},
    "required": ["to", "express"],
    "additionalProperties": False,
    "$defs": {"Address": ADDRESS},
}
NOTE = {
    "type": "object",
    "properties": {"at": {"$ref": "#/$defs/Address"}},
    "required": ["at"],
    "additionalProperties": False,
    "$defs": {"Address": {"enum": ["home"]}},
}
TOOLS = [
    {"type": "function", "function": {"name": "ship", "parameters": SHIP}},
    {"type": "function", "function": {"name": "note", "parameters": NOTE}},
]


def _body(**extra) -> dict:
    return {
        "messages": [{"role": "user", "content": "Ship it."}],
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 80,
        "temperature": 0,
        **extra,
    }


def _check(name: str, arguments: str) -> None:
    args = json.loads(arguments)
    if name == "ship":
        assert set(args) == {"to", "express"} and isinstance(args["express"], bool)
        assert args["to"]["city"] in ("Paris", "Oslo") and args["to"]["zip"] in ("75001", "0150")
    else:
        assert (name, args) == ("note", {"at": "home"})


def test_references_point_into_each_tools_own_schema() -> None:
    req = ChatCompletionRequest.model_validate(_body())
    schema = json.loads(plan_tools(req, None).constraint.json)
    ship, note = (item["properties"]["parameters"] for item in schema["items"]["anyOf"])
    assert ship["properties"]["to"] == {"$ref": "#/items/anyOf/0/properties/parameters/$defs/Address"}
    assert note["properties"]["at"] == {"$ref": "#/items/anyOf/1/properties/parameters/$defs/Address"}
    assert ship["$defs"] == SHIP["$defs"] and TOOLS[0]["function"]["parameters"] is SHIP  # request untouched
    assert SHIP["properties"]["to"] == {"$ref": "#/$defs/Address"}


def test_only_schemas_references_are_rebased() -> None:
    # A property named like a data keyword is still a schema; a "$ref" inside data is not a reference.
    params = {
        "type": "object",
        "properties": {"default": {"anyOf": [{"$ref": "#/$defs/A"}, {"const": {"$ref": "#/x"}}]}},
        "$defs": {"A": {"enum": [{"$ref": "#"}]}},
    }
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    req = ChatCompletionRequest.model_validate({**_body(), "tools": tools})
    (item,) = json.loads(plan_tools(req, None).constraint.json)["items"]["anyOf"]
    base = "#/items/anyOf/0/properties/parameters"
    assert item["properties"]["parameters"] == {
        "type": "object",
        "properties": {"default": {"anyOf": [{"$ref": base + "/$defs/A"}, {"const": {"$ref": "#/x"}}]}},
        "$defs": {"A": {"enum": [{"$ref": "#"}]}},
    }


def test_required_call_follows_the_nested_schema(server) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", json=_body(), timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    ((call),) = choice["message"]["tool_calls"]
    _check(call["function"]["name"], call["function"]["arguments"])
    streamed = {"name": "", "arguments": ""}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=_body(stream=True), timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    for d in c["delta"].get("tool_calls") or []:
                        streamed["name"] += d["function"].get("name") or ""
                        streamed["arguments"] += d["function"].get("arguments") or ""
    assert streamed == {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}
