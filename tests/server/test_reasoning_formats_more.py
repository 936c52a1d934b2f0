"""The reasoning parsers for Step-3 / 3.5, Olmo 3, ERNIE-4.5, Hunyuan-A13B, Kimi-K2, MiMo, Holo2 and
Nemotron 3, without a server: exact (reasoning, content) splits of whole answers, the same split
streamed however the text is cut (a character at a time included), and what a chat client gets with
each model's tool parser."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.reasoning_parsers import REASONING_PARSERS, reasoning_splitter
from tests.server.test_reasoning_parsers import check_on_the_wire

CASES = [
    # Step-3 and Olmo 3: the prompt opened the thinking, as deepseek_r1's
    ("step3", "Add them.</think>\n\n4", "Add them.", "4"),
    ("step3", "cut off while thinking", "cut off while thinking", ""),
    ("olmo3", "<think>Add them.</think>4", "Add them.", "4"),
    ("olmo3", "Add them.</think>4", "Add them.", "4"),
    ("olmo3", "a </thin", "a </thin", ""),
    # ERNIE-4.5: the answer maybe inside <response> ... </response> (vLLM keeps the newlines inside)
    ("ernie45", "abc\n</think>\n\n<response>\ndef\n</response>\n", "abc\n", "\ndef\n"),
    ("ernie45", "abc\n</think>\ndef", "abc\n", "def"),
    ("ernie45", "abc</think><respo", "abc", "<respo"),  # cut inside the opening: it stays text
    ("ernie45", "abc</think><response>x</resp", "abc", "x</resp"),
    ("ernie45", "abc</think>a <response> b", "abc", "a <response> b"),  # not at the start: text
    ("ernie45", "thinking only", "thinking only", ""),
    # Hunyuan-A13B: <think>\n ... \n</think>\n<answer>\n ... \n</answer>, thinking only after <think>
    ("hunyuan_a13b", "<think>\nAdd them.\n</think>\n<answer>\n4\n</answer>", "Add them.", "4"),
    ("hunyuan_a13b", "<think>\n\n</think>\n<answer>\n4\n</answer>", None, "4"),  # its fast mode
    ("hunyuan_a13b", "4\n</answer>", None, "4"),  # the prompt opened the answer
    ("hunyuan_a13b", "<think>\nAdd.\n</think>\n<answer>4</answer>", "Add.", "4"),
    ("hunyuan_a13b", "<think>\ncut off", "cut off", ""),
    ("hunyuan_a13b", "Just 4.", None, "Just 4."),
    ("hunyuan_a13b", "<think>\nAdd.\n</think>\n<answer>\n4\n</ans", "Add.", "4\n</ans"),
    # Kimi-K2: a tool-call section ends the thought and stays in the content
    ("kimi_k2", "<think>Weather?</think>\n\nIt is sunny.", "Weather?", "It is sunny."),
    ("kimi_k2", "Weather?<|tool_calls_section_begin|>x", "Weather?", "<|tool_calls_section_begin|>x"),
    ("kimi_k2", "still thinking <|tool_calls_sec", "still thinking <|tool_calls_sec", ""),
    # MiMo reads as qwen3, Holo2 as deepseek_v3 (both decided by the prompt; by default: an opening <think>)
    ("mimo", "<think>plan</think>\n\nanswer", "plan", "answer"),
    ("mimo", "no thinking", None, "no thinking"),
    ("holo2", "<think>plan</think>answer", "plan", "answer"),
    ("nemotron_v3", "<think>plan</think>answer", "plan", "answer"),
    ("nemotron_v3", "plan</think>answer", None, "plan</think>answer"),  # the prompt did not open it
    # Step-3.5: deepseek_r1's split, without the newline before </think>
    ("step3p5", "Add them.\n</think>\n4", "Add them.", "4"),
    ("step3p5", "Add them.\n\n</think>4", "Add them.\n", "4"),
    ("step3p5", "Add them.\n", "Add them.\n", ""),
]


@pytest.mark.parametrize(("parser", "text", "reasoning", "content"), CASES)
def test_split(parser, text, reasoning, content) -> None:
    assert reasoning_splitter(parser).split(text) == (reasoning, content)


def _streamed(parser: str, text: str, cuts: list[int]) -> tuple[str | None, str]:
    splitter, got_r, got_c, last = reasoning_splitter(parser), "", "", 0
    for cut in [*cuts, len(text)]:
        r, c = splitter.feed(text[last:cut])
        got_r, got_c, last = got_r + r, got_c + c, cut
    r, c = splitter.finish()
    return (got_r + r) or None, got_c + c


@pytest.mark.parametrize(("parser", "text", "reasoning", "content"), CASES)
def test_streamed_a_character_at_a_time(parser, text, reasoning, content) -> None:
    assert _streamed(parser, text, list(range(len(text)))) == (reasoning, content)


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(CASES), data=st.data())
def test_streaming_equals_split_for_any_cut(case, data) -> None:
    parser, text, reasoning, content = case
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(text)), max_size=10))))
    assert _streamed(parser, text, cuts) == (reasoning, content)


def test_markers_never_reach_a_delta() -> None:
    """What is sent as soon as it is decided: a marker's first characters are held, never shown."""
    hunyuan = reasoning_splitter("hunyuan_a13b")
    assert hunyuan.feed("<think>\nStep one.\n</th") == ("Step one.", "")
    assert hunyuan.feed("ink>\n<answer>\n4") == ("", "4")
    assert hunyuan.feed("\n</ans") == ("", "")
    assert hunyuan.feed("wer>") == ("", "")
    assert hunyuan.finish() == ("", "")
    ernie = reasoning_splitter("ernie45")
    assert ernie.feed("plan</think>\n\n<resp") == ("plan", "")
    assert ernie.feed("onse>\nyes</response>") == ("", "\nyes")
    kimi = reasoning_splitter("kimi_k2")
    assert kimi.feed("plan <|tool_calls") == ("plan ", "")
    assert kimi.feed("_section_begin|>") == ("", "<|tool_calls_section_begin|>")


def test_kimi_reads_the_prompt() -> None:
    """K2.5's template with thinking off closes the thought in the prompt: the answer is content."""
    kimi = REASONING_PARSERS["kimi_k2"]
    assert kimi.prompt_decides
    assert kimi.requires_start_after("<|im_assistant|>assistant<|im_middle|><think></think>")
    assert not kimi.requires_start_after("<|im_assistant|>assistant<|im_middle|>")
    closed = kimi(requires_start=True)
    assert closed.split("plan</think>answer") == (None, "plan</think>answer")
    assert kimi(requires_start=False).split("plan</think>answer") == ("plan", "answer")
    # The other parsers the prompt decides still look for an opening <think> at its end.
    assert not REASONING_PARSERS["mimo"].requires_start_after("<|im_start|>assistant\n<think>\n")
    assert REASONING_PARSERS["mimo"].requires_start_after("<|im_start|>assistant\n")
    nemotron = REASONING_PARSERS["nemotron_v3"]  # enable_thinking: false closes it in the prompt
    assert nemotron.requires_start_after("<|im_start|>assistant\n<think></think>")
    assert not nemotron.requires_start_after("<|im_start|>assistant\n<think>\n")


PAIRS = [
    (
        "kimi_k2",
        "kimi_k2",
        "<think>Need the weather.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|><|tool_calls_section_end|>',
        "Need the weather.",
        None,
    ),
    (
        "ernie45",
        "ernie45",
        'Need the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
        "</tool_call>\n",
        "Need the weather.\n",
        None,
    ),
    (
        "hunyuan_a13b",
        "hunyuan_a13b",
        "<think>\nNeed the weather.\n</think>\n<answer>\nChecking.<tool_calls>"
        '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]</tool_calls>\n</answer>',
        "Need the weather.",
        "Checking.",
    ),
    (
        "step3",
        "step3",
        "Need the weather.</think>\n<｜tool_calls_begin｜><｜tool_call_begin｜>function<｜tool_sep｜>"
        '<steptml:invoke name="get_weather"><steptml:parameter name="city">Oslo</steptml:parameter>'
        "</steptml:invoke><｜tool_call_end｜><｜tool_calls_end｜>",
        "Need the weather.",
        None,
    ),
    (
        "olmo3",
        "olmo3",
        "Need the weather.</think>\n<function_calls>\nget_weather(city='Oslo')\n</function_calls>",
        "Need the weather.",
        None,
    ),
]


@pytest.mark.parametrize(("reasoning_parser", "tool_parser", "text", "reasoning", "content"), PAIRS)
def test_on_the_wire_whole_and_cut_anywhere(reasoning_parser, tool_parser, text, reasoning, content):
    check_on_the_wire(reasoning_parser, tool_parser, text, reasoning, content)
