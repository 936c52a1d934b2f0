"""A model that loops on ``[`` or ``{`` writes JSON nested deeper than Python's stack: every parser
reads such a call as text that is not a call (content), whole or streamed, never failing the
request; so does a ``required`` answer."""

from __future__ import annotations

import pytest

from server.tool_parsers import get_tool_parser
from server.tools import ToolPlan

DEEP = "[" * 50_000 + "]" * 50_000
CALLS = {
    "hermes": '<tool_call>{"name": "f", "arguments": {"x": ' + DEEP + "}}</tool_call>",
    "mistral": "[TOOL_CALLS]" + DEEP,
    "llama3_json": '{"name": "f", "parameters": {"x": ' + DEEP + "}}",
    "granite": "<|tool_call|>" + DEEP,
    "phi4_mini_json": "functools" + DEEP,
    "deepseek_v31": '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{"x": '
    + DEEP
    + "}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
    '{"x": ' + DEEP + "}<|tool_call_end|><|tool_calls_section_end|>",
    "openai": 'to=functions.f<|message|>{"x": ' + DEEP + "}<|call|>",
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_too_deep_json_is_content(name: str) -> None:
    text = CALLS[name]
    parser = get_tool_parser(name)
    assert parser.parse(text) == (text, [])
    streamer = parser.streamer()
    content = "".join(streamer.feed(text[i : i + 4096])[0] for i in range(0, len(text), 4096))
    more, calls = streamer.finish()
    assert (content + more, calls) == (text, [])


def test_too_deep_required_answer_is_content() -> None:
    text = '[{"name": "f", "parameters": {"x": ' + DEEP + "}}]"
    assert ToolPlan("required").read(text) == (text, [])
