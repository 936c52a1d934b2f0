"""How the text-argument formats type each value by the request's tool schema, as vLLM's parsers of
the same names do: ``qwen3_coder`` by the declared type's name (undeclared parameters and untyped
ones stay text, ``null`` is null), ``glm45`` decoding anything not declared a string as JSON, else as
a Python literal."""

from __future__ import annotations

import json

import pytest

from server.tool_parsers import get_tool_parser
from server.tools import plan_tools, validated_tools
from tests.server.test_tool_parsers import _req

PROPS = {
    "s": {"type": "string"},
    "i": {"type": "integer"},
    "n": {"type": "number"},
    "b": {"type": "boolean"},
    "o": {"type": "object"},
    "a": {"type": "array"},
    "opt": {"type": ["string", "null"]},
    "untyped": {"enum": ["1", "2"]},
}
TOOLS = validated_tools(
    [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": PROPS}}}]
)


def _qwen3_coder(key: str, value: str) -> object:
    text = f"<tool_call>\n<function=f>\n<parameter={key}>\n{value}\n</parameter>\n</function>\n</tool_call>"
    content, calls = get_tool_parser("qwen3_coder").for_tools(TOOLS).parse(text)
    assert content == "" and len(calls) == 1
    return json.loads(calls[0].arguments)[key]


def _glm45(key: str, value: str) -> object:
    text = f"<tool_call>f\n<arg_key>{key}</arg_key>\n<arg_value>{value}</arg_value>\n</tool_call>"
    content, calls = get_tool_parser("glm45").for_tools(TOOLS).parse(text)
    assert content == "" and len(calls) == 1
    return json.loads(calls[0].arguments)[key]


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("s", "null", None),  # null whatever the type
        ("s", "NULL", None),
        ("s", "42", "42"),
        ("extra", "42", "42"),  # not declared: text
        ("untyped", "1", "1"),  # declared without a type: text
        ("i", "7", 7),
        ("i", "seven", "seven"),
        ("n", "3.0", 3),
        ("n", "2.5", 2.5),
        ("n", "inf", "inf"),  # JSON holds no infinity: text
        ("b", "True", True),
        ("b", "false", False),
        ("b", "no", False),
        ("o", '{"a": {"b": [1, "}"]}}', {"a": {"b": [1, "}"]}}),
        ("o", "{'a': 1}", {"a": 1}),  # a Python dict, read as a literal (never evaluated)
        ("o", "{'a': open('x')}", "{'a': open('x')}"),
        ("a", "[1, 2]", [1, 2]),
        ("opt", "42", "42"),
        ("opt", "null", None),
    ],
)
def test_qwen3_coder_types_as_vllm(key: str, value: str, expected: object) -> None:
    assert _qwen3_coder(key, value) == expected


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("s", "True", "True"),
        ("s", "null", "null"),  # a string stays the text written
        ("b", "True", True),  # a Python literal where JSON fails
        ("o", "{'a': (1, 2)}", {"a": [1, 2]}),
        ("o", "{1, 2}", "{1, 2}"),  # a set: JSON cannot hold it, so text
        ("extra", "5", 5),  # not declared: decoded
        ("i", "x + 1", "x + 1"),
    ],
)
def test_glm45_types_as_vllm(key: str, value: str, expected: object) -> None:
    assert _glm45(key, value) == expected


@pytest.mark.parametrize(
    "parser", ["qwen3_coder", "glm45", "minimax_m2", "step3", "seed_oss", "mimo", "step3p5"]
)
@pytest.mark.parametrize("properties", ["city", 5, ["city"], True])
def test_a_tool_whose_properties_are_not_an_object_is_read_untyped(parser: str, properties: object) -> None:
    """A client's ``properties`` that is not an object (a broken schema "auto" never compiles) leaves
    the tool's values untyped: it never fails the request (it was a 500)."""
    tools = [
        {
            "type": "function",
            "function": {"name": "f", "parameters": {"type": "object", "properties": properties}},
        }
    ]
    plan = plan_tools(_req(tools=tools), get_tool_parser(parser))
    assert plan is not None and plan.mode == "auto"
    assert plan.parser.schemas == {"f": {}}
