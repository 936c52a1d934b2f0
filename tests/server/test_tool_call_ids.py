"""Tool-call ids as the next turn needs them: Kimi-K2's own ids (``functions.NAME:i``, which its
chat template writes back into the history) kept, and Mistral's 9 letters or digits (its templates
refuse any other id), whole and streamed, for every ``tool_choice``."""

from __future__ import annotations

import re

from server.chat_protocol import ChatCompletionRequest
from server.tool_parsers import get_tool_parser
from server.tools import ChoiceTools, ToolPlan, plan_tools

KIMI = (
    "Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    '{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>now:1<|tool_call_argument_begin|>{}<|tool_call_end|>'
    "<|tool_calls_section_end|>"
)
MISTRAL = (
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "now", "arguments": {}}]'
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {"type": "function", "function": {"name": "now"}},
]
MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


def _streamed(plan: ToolPlan, text: str, step: int) -> list[tuple[int, str | None, str | None]]:
    tools = ChoiceTools(plan)
    deltas = []
    for i in range(0, len(text), step):
        deltas += tools.feed(text[i : i + step])[1]
    deltas += tools.finish()[1]
    return [(d.index, d.id, d.function.name) for d in deltas]


def _req(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def test_kimi_k2_calls_keep_the_models_ids() -> None:
    plan = ToolPlan("auto", parser=get_tool_parser("kimi_k2"))
    content, calls = plan.read(KIMI)
    assert content == "Sure."
    assert [(c.id, c.function.name, c.function.arguments) for c in calls] == [
        ("functions.get_weather:0", "get_weather", '{"city": "Paris"}'),
        ("now:1", "now", "{}"),
    ]
    for step in (1, 7, len(KIMI)):
        assert _streamed(plan, KIMI, step) == [
            (0, "functions.get_weather:0", "get_weather"),
            (1, "now:1", "now"),
        ]


def test_mistral_call_ids_are_nine_letters_or_digits() -> None:
    parser = get_tool_parser("mistral")
    auto = plan_tools(_req(tools=TOOLS), parser)
    _, calls = auto.read(MISTRAL)
    assert [c.function.name for c in calls] == ["get_weather", "now"]
    assert all(MISTRAL_ID.fullmatch(c.id) for c in calls) and calls[0].id != calls[1].id
    streamed = _streamed(auto, MISTRAL, 5)
    assert [(i, name) for i, _, name in streamed] == [(0, "get_weather"), (1, "now")]
    assert all(MISTRAL_ID.fullmatch(call_id) for _, call_id, _ in streamed)
    # Forced calls on a Mistral server go into the same history: the same ids.
    named = plan_tools(
        _req(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "now"}}), parser
    )
    assert MISTRAL_ID.fullmatch(named.read("{}")[1][0].id)
    assert MISTRAL_ID.fullmatch(_streamed(named, "{}", 1)[0][1])
    required = plan_tools(_req(tools=TOOLS, tool_choice="required"), parser)
    assert MISTRAL_ID.fullmatch(required.read('[{"name": "now", "parameters": {}}]')[1][0].id)


def test_other_formats_keep_openai_style_ids() -> None:
    hermes = plan_tools(_req(tools=TOOLS), get_tool_parser("hermes"))
    _, calls = hermes.read('<tool_call>{"name": "now", "arguments": {}}</tool_call>')
    assert re.fullmatch(r"call_[0-9a-f]{24}", calls[0].id)
    named = plan_tools(_req(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "now"}}), None)
    assert re.fullmatch(r"call_[0-9a-f]{24}", named.read("{}")[1][0].id)
