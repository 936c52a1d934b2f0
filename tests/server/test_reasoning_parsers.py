"""Reasoning parsers without a server: exact (reasoning, content) splits, and streaming that gives
the same split however the text is cut into deltas."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.chat_shape import ChoiceShaper, shape_whole
from server.reasoning_parsers import REASONING_PARSERS, reasoning_splitter
from server.tool_parsers import get_tool_parser
from server.tools import ToolPlan

CASES = [
    (
        "deepseek_r1",
        "Let me think.\nOK.</think>\n\nThe answer is 4.",
        "Let me think.\nOK.",
        "The answer is 4.",
    ),
    ("deepseek_r1", "<think>\nhmm</think>42", "hmm", "42"),  # an opening <think> the model wrote anyway
    ("deepseek_r1", "still thinking when cut off", "still thinking when cut off", ""),
    ("deepseek_r1", "</think>direct", None, "direct"),
    ("deepseek_r1", "a < b </thin k", "a < b </thin k", ""),
    ("qwen3", "<think>\nhmm</think>\n\n42", "hmm", "42"),
    ("qwen3", "Just 42, no thinking.", None, "Just 42, no thinking."),
    ("qwen3", "<think>unclosed", "unclosed", ""),
    ("qwen3", "<thi", None, "<thi"),
    ("qwen3", "  \n<think>x</think>y", "x", "y"),
    # gpt-oss's harmony channels (special tokens kept in the text)
    (
        "openai_gptoss",
        "<|channel|>analysis<|message|>2 + 2 is 4.<|end|><|start|>assistant<|channel|>final<|message|>4.",
        "2 + 2 is 4.",
        "4.",
    ),
    ("openai_gptoss", "<|channel|>final<|message|>Just 4.", None, "Just 4."),
    ("openai_gptoss", "<|channel|>analysis<|message|>cut off while thinking", "cut off while thinking", ""),
    (
        "openai_gptoss",
        "<|channel|>analysis<|message|>Weather?<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}',
        "Weather?",
        'to=functions.get_weather<|message|>{"city": "Oslo"}<|call|>',
    ),
    (  # the recipient before the channel, and a preamble on commentary
        "openai_gptoss",
        "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.f"
        "<|channel|>commentary json<|message|>{}",
        None,
        "Checking.to=functions.f<|message|>{}<|call|>",
    ),
    ("openai_gptoss", '{"a": 1}', None, '{"a": 1}'),  # no harmony (a constrained answer): content
    ("openai_gptoss", "<|channel|>analy", None, ""),  # cut inside a header: nothing to show
]


@pytest.mark.parametrize(("parser", "text", "reasoning", "content"), CASES)
def test_split(parser, text, reasoning, content) -> None:
    assert reasoning_splitter(parser).split(text) == (reasoning, content)


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(CASES), data=st.data())
def test_streaming_equals_split_for_any_cut(case, data) -> None:
    parser, text, reasoning, content = case
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(text)), max_size=10))))
    splitter, got_r, got_c, last = reasoning_splitter(parser), "", "", 0
    for cut in [*cuts, len(text)]:
        r, c = splitter.feed(text[last:cut])
        got_r, got_c, last = got_r + r, got_c + c, cut
    r, c = splitter.finish()
    assert ((got_r + r) or None, got_c + c) == (reasoning, content)


def test_thinking_streams_before_it_ends() -> None:
    splitter = reasoning_splitter("deepseek_r1")
    assert splitter.feed("Step one. </th") == ("Step one. ", "")  # "</th" may close it: held
    assert splitter.feed("ink>\n\nDone") == ("", "Done")
    assert splitter.feed(" now") == ("", " now")


def test_reasoning_then_a_tool_call() -> None:
    text = 'Need the time.</think>\n\n<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    plan = ToolPlan("auto", parser=get_tool_parser("hermes"))
    reasoning, content, calls = shape_whole(text, plan, reasoning_splitter("deepseek_r1"))
    assert reasoning == "Need the time." and content is None
    assert [(c.function.name, c.function.arguments) for c in calls] == [("now", "{}")]
    shaper = ChoiceShaper(plan, reasoning_splitter("deepseek_r1"))
    parts = [shaper.feed(text[i : i + 7]) for i in range(0, len(text), 7)] + [shaper.finish()]
    assert "".join(p.reasoning for p in parts) == "Need the time."
    assert "".join(p.content for p in parts) == ""
    assert [d.function.name for p in parts for d in p.tool_calls] == ["now"]


def test_harmony_reasoning_then_a_tool_call() -> None:
    text = (
        "<|channel|>analysis<|message|>Use the tool.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}'
    )
    plan = ToolPlan("auto", parser=get_tool_parser("openai"))
    reasoning, content, calls = shape_whole(text, plan, reasoning_splitter("openai_gptoss"))
    assert reasoning == "Use the tool." and content is None
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", '{"city": "Oslo"}')]
    shaper = ChoiceShaper(plan, reasoning_splitter("openai_gptoss"))
    parts = [shaper.feed(text[i : i + 5]) for i in range(0, len(text), 5)] + [shaper.finish()]
    assert "".join(p.reasoning for p in parts) == "Use the tool."
    assert "".join(p.content for p in parts) == ""
    assert [d.function.name for p in parts for d in p.tool_calls] == ["get_weather"]
    # Without the reasoning parser, the raw harmony call reads the same.
    raw = get_tool_parser("openai").parse(
        '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"x": 1}'
    )
    assert [(c.name, c.arguments) for c in raw[1]] == [("f", '{"x": 1}')]
    assert get_tool_parser("openai").parse("to=functions.f<|message|>not json") == (
        "to=functions.f<|message|>not json",
        [],
    )


def test_harmony_reasoning_streams_before_its_message_ends() -> None:
    splitter = reasoning_splitter("openai_gptoss")
    assert splitter.feed("<|channel|>analysis<|mess") == ("", "")  # a header: held
    assert splitter.feed("age|>Step one. <|en") == ("Step one. ", "")  # "<|en" may end it: held
    assert splitter.feed("d|><|start|>assistant<|channel|>final<|message|>Done") == ("", "Done")


def test_registry() -> None:
    assert sorted(REASONING_PARSERS) == ["deepseek_r1", "deepseek_v3", "glm45", "openai_gptoss", "qwen3"]
    glm = reasoning_splitter("glm45")  # GLM-4.5 thinks as Qwen3 does: only after an opening <think>
    assert glm.feed("<think>plan</think>\n\nanswer") == ("plan", "answer")
    assert reasoning_splitter("glm45").feed("plain answer") == ("", "plain answer")
    with pytest.raises(ValueError, match="unknown reasoning parser 'x'"):
        reasoning_splitter("x")


def test_deepseek_v3_reads_the_prompt() -> None:
    from server.reasoning_parsers import prompt_opens_thinking

    assert prompt_opens_thinking("<｜Assistant｜><think>") and prompt_opens_thinking("x<think>\n")
    assert not prompt_opens_thinking("<｜Assistant｜></think>") and not prompt_opens_thinking("hi")
    opened = REASONING_PARSERS["deepseek_v3"](requires_start=False)  # the prompt opened <think>
    assert opened.feed("plan</think>answer") == ("plan", "answer")
    closed = REASONING_PARSERS["deepseek_v3"]()  # it did not: all content
    assert closed.feed("plan</think>answer") == ("", "plan</think>answer")
