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


def test_registry() -> None:
    assert sorted(REASONING_PARSERS) == ["deepseek_r1", "deepseek_v3", "glm45", "qwen3"]
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
