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
    ("qwen3", "<think>\n\nhmm</think>\n\n42", "hmm", "42"),
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
    # Magistral: [THINK] ... [/THINK] (control tokens kept in the text), only after an opening [THINK]
    ("mistral", "[THINK]2 + 2 = 4.[/THINK]The answer is 4.", "2 + 2 = 4.", "The answer is 4."),
    ("mistral", "Just 4.", None, "Just 4."),
    ("mistral", "[THINK]cut off", "cut off", ""),
    ("mistral", "[THI", None, "[THI"),
    ("mistral", "[THINK]a [/THIN", "a [/THIN", ""),
    ("mistral", "<think>x</think>y", None, "<think>x</think>y"),  # not its markers
    # Granite 3.2/3.3: plain-text markers, either spelling
    (
        "granite",
        "Here is my thought process:\nAdd them.\nHere is my response:\n4",
        "Add them.\n",
        "4",
    ),
    ("granite", "Here's my thought process: sum. Here's my response: 4", " sum. ", " 4"),
    ("granite", "Here is my thought process: cut off", " cut off", ""),
    ("granite", "The answer is 4.", None, "The answer is 4."),
    ("granite", "Here is my answer: 4", None, "Here is my answer: 4"),
    ("granite", "Here is my thought process: a Here is my resp", " a Here is my resp", ""),
    # Seed-OSS: <seed:think> ... </seed:think>, thinking from the start as deepseek_r1's
    ("seed_oss", "<seed:think>Add.</seed:think>4", "Add.", "4"),
    ("seed_oss", "Add.</seed:think>\n\n4", "Add.", "4"),
    ("seed_oss", "no end", "no end", ""),
    ("seed_oss", "<think>x</think>y", "<think>x</think>y", ""),  # not its markers
    # MiniMax-M2: the prompt opened <think>, as deepseek_r1's
    ("minimax_m2", "plan</think>\n\nanswer", "plan", "answer"),
    # ... or the thinking left in the content, its <think> written back in front
    ("minimax_m2_append_think", "plan</think>\n\nanswer", None, "<think>plan</think>\n\nanswer"),
    ("minimax_m2_append_think", "", None, "<think>"),
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


@pytest.mark.parametrize("text", ["Still thinking when max_tokens came", "Thought.</think>", ""])
def test_a_named_call_with_no_arguments_written_is_no_call(text) -> None:
    """A named tool choice whose answer ends before any argument text (cut off while thinking) makes
    no call, whole as streamed: a call whose arguments are "" is not JSON (the whole answer had one)."""
    plan = ToolPlan("named", name="get_weather")
    reasoning, content, calls = shape_whole(text, plan, reasoning_splitter("deepseek_r1"))
    assert (content, calls) == (None, [])
    shaper = ChoiceShaper(plan, reasoning_splitter("deepseek_r1"))
    parts = [shaper.feed(text[i : i + 5]) for i in range(0, len(text), 5)] + [shaper.finish()]
    assert "".join(p.reasoning for p in parts) == (reasoning or "")
    assert [d for p in parts for d in p.tool_calls] == [] and "".join(p.content for p in parts) == ""


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
    assert sorted(REASONING_PARSERS) == [
        "deepseek_r1",
        "deepseek_v3",
        "ernie45",
        "glm45",
        "glm47",
        "granite",
        "holo2",
        "hunyuan_a13b",
        "kimi_k2",
        "mimo",
        "minimax_m2",
        "minimax_m2_append_think",
        "mistral",
        "nemotron_v3",
        "olmo3",
        "openai_gptoss",
        "qwen3",
        "seed_oss",
        "step3",
        "step3p5",
    ]
    glm = reasoning_splitter("glm45")  # GLM-4.5 thinks as Qwen3 does: only after an opening <think>
    assert glm.feed("<think>plan</think>\n\nanswer") == ("plan", "answer")
    assert reasoning_splitter("glm45").feed("plain answer") == ("", "plain answer")
    with pytest.raises(ValueError, match="unknown reasoning parser 'x'"):
        reasoning_splitter("x")


def test_deepseek_v3_reads_the_prompt() -> None:
    from server.reasoning_base import prompt_opens_thinking

    assert prompt_opens_thinking("<｜Assistant｜><think>") and prompt_opens_thinking("x<think>\n")
    assert not prompt_opens_thinking("<｜Assistant｜></think>") and not prompt_opens_thinking("hi")
    opened = REASONING_PARSERS["deepseek_v3"](requires_start=False)  # the prompt opened <think>
    assert opened.feed("plan</think>answer") == ("plan", "answer")
    closed = REASONING_PARSERS["deepseek_v3"]()  # it did not: all content
    assert closed.feed("plan</think>answer") == ("", "plan</think>answer")


def test_new_parsers_stream_before_the_end_marker() -> None:
    mistral = reasoning_splitter("mistral")
    assert mistral.feed("[THINK]Step one. [/TH") == ("Step one. ", "")  # "[/TH" may end it: held
    assert mistral.feed("INK]Done") == ("", "Done")
    granite = reasoning_splitter("granite")
    assert granite.feed("Here") == ("", "")  # may open the thought process: held
    assert granite.feed(" is my thought process: ok. Here") == (" ok. ", "")
    assert granite.feed("'s my response: yes") == ("", " yes")
    appended = reasoning_splitter("minimax_m2_append_think")
    assert appended.feed("a") == ("", "<think>a") and appended.feed("b") == ("", "b")
    assert appended.finish() == ("", "")


def test_thinking_budget_needs_think_markers_of_the_engine() -> None:
    """The engine forces ``</think>``: parsers with other markers refuse a budget (a 400 naming the
    parser), those with <think> take it."""
    from server.errors import APIError
    from server.reasoning_parsers import thinking_budget

    for name in ("deepseek_r1", "qwen3", "glm45", "glm47", "deepseek_v3", "minimax_m2", "kimi_k2", "ernie45"):
        assert thinking_budget(REASONING_PARSERS[name], name, 7) == 7
    for name in (
        "mistral",
        "granite",
        "seed_oss",
        "minimax_m2_append_think",
        "openai_gptoss",
        "hunyuan_a13b",
    ):
        with pytest.raises(APIError, match=f"--reasoning-parser {name} has no <think>"):
            thinking_budget(REASONING_PARSERS[name], name, 7)
    with pytest.raises(
        APIError,
        match=r"\(deepseek_r1, qwen3, glm45, glm47, deepseek_v3, minimax_m2, step3, olmo3, ernie45, "
        r"kimi_k2, mimo, holo2, nemotron_v3, step3p5: the models",
    ):
        thinking_budget(None, None, 7)


def test_harmony_reasoning_tokens_are_analysis_and_commentary_messages() -> None:
    """As vLLM's HarmonyContext counts (a token read while its parser is in an ``analysis`` or
    ``commentary`` message, ``<|message|>`` on): each such message from its ``<|message|>`` to its
    body's end, the end marker not in it; ``final`` bodies and the headers are not."""
    from server.reasoning_tokens import reasoning_spans

    text = (
        "<|channel|>analysis<|message|>Think.<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
        "<|start|>assistant to=functions.f<|channel|>commentary <|constrain|>json<|message|>{}<|call|>"
        "<|start|>assistant<|channel|>final<|message|>Done.<|return|>"
        "<|start|>assistant<|channel|>analysis<|message|>cut"
    )

    def span(body: str, after: int = 0) -> tuple[int, int]:
        at = text.index("<|message|>" + body, after)
        return at, at + len("<|message|>" + body)

    assert reasoning_spans(text) == [span("Think."), span("Checking."), span("{}"), span("cut")]
    assert reasoning_spans("<|channel|>final<|message|>Only an answer.") == []
    assert reasoning_spans("no harmony") == []


PAIRS = [
    (  # Magistral: [THINK] ... [/THINK] then [TOOL_CALLS]
        "mistral",
        "mistral",
        "[THINK]Need the weather.[/THINK]"
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
        "Need the weather.",
        None,
    ),
    (
        "seed_oss",
        "seed_oss",
        "<seed:think>Need the weather.</seed:think>\n<seed:tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nOslo\n</parameter>\n</function>\n</seed:tool_call>",
        "Need the weather.",
        None,
    ),
    (
        "minimax_m2",
        "minimax_m2",
        'Need the weather.</think>\n\nChecking.<minimax:tool_call>\n<invoke name="get_weather">\n'
        '<parameter name="city">Oslo</parameter>\n</invoke>\n</minimax:tool_call>',
        "Need the weather.",
        "Checking.",
    ),
    (  # MiniMax's recommended pairing: the thinking stays in the content, the call is read after it
        "minimax_m2_append_think",
        "minimax_m2",
        'Need the weather.</think>\n<minimax:tool_call><invoke name="get_weather">'
        '<parameter name="city">Oslo</parameter></invoke></minimax:tool_call>',
        None,
        "<think>Need the weather.</think>\n",
    ),
    (
        "granite",
        "granite",
        "Here is my thought process:\nNeed the weather.\nHere is my response:\n"
        '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
        "Need the weather.\n",
        None,
    ),
]


@pytest.mark.parametrize(("reasoning_parser", "tool_parser", "text", "reasoning", "content"), PAIRS)
def test_new_parsers_on_the_wire_whole_and_cut_anywhere(
    reasoning_parser, tool_parser, text, reasoning, content
):
    check_on_the_wire(reasoning_parser, tool_parser, text, reasoning, content)


def check_on_the_wire(
    reasoning_parser: str, tool_parser: str, text: str, reasoning: str | None, content: str | None
) -> None:
    """What a chat client gets (reasoning, content, one get_weather call with its arguments as JSON
    text), whole and streamed in two deltas cut at every point, or character by character."""
    plan = ToolPlan("auto", parser=get_tool_parser(tool_parser))
    got_r, got_c, calls = shape_whole(text, plan, reasoning_splitter(reasoning_parser))
    assert (got_r, got_c) == (reasoning, content)
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", '{"city": "Oslo"}')]
    for cuts in [[i] for i in range(len(text) + 1)] + [list(range(len(text) + 1))]:
        shaper, last, parts = ChoiceShaper(plan, reasoning_splitter(reasoning_parser)), 0, []
        for cut in [*cuts, len(text)]:
            parts.append(shaper.feed(text[last:cut]))
            last = cut
        parts.append(shaper.finish())
        assert "".join(p.reasoning for p in parts) == (reasoning or "")
        assert "".join(p.content for p in parts) == (content or "")
        deltas = [d for p in parts for d in p.tool_calls]
        assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
            (0, "get_weather", '{"city": "Oslo"}')
        ]


def test_reasoning_tokens_count_between_each_parsers_own_markers(tiny_llama) -> None:
    """``reasoning_tokens`` counts the tokens between the parser's own markers (several tokens each
    in this tokenizer), the markers not counted; a parser without marker tokens counts 0."""
    from types import SimpleNamespace

    from engine.tokenizer import Tokenizer
    from server.reasoning_tokens import reasoning_counter

    tok = Tokenizer.from_dir(tiny_llama)

    def ids(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False))

    thought = ids(" one two three")
    for name, start, end in [
        ("mistral", "[THINK]", "[/THINK]"),
        ("seed_oss", "<seed:think>", "</seed:think>"),
    ]:
        count = reasoning_counter(SimpleNamespace(reasoning=REASONING_PARSERS[name], tokenizer=tok), False)
        assert count(ids(start) + thought + ids(end) + ids(" answer")) == len(thought)
        assert count(ids(" no thinking")) == 0
    opened = reasoning_counter(SimpleNamespace(reasoning=REASONING_PARSERS["seed_oss"], tokenizer=tok), True)
    assert opened(thought + ids("</seed:think>") + ids(" answer")) == len(thought)
    granite = reasoning_counter(SimpleNamespace(reasoning=REASONING_PARSERS["granite"], tokenizer=tok), False)
    assert granite(ids("Here is my thought process: a Here is my response: b")) == 0
    # Kimi-K2: a tool-call section ends the thought as </think> does (its tokens are the content's)
    kimi = reasoning_counter(SimpleNamespace(reasoning=REASONING_PARSERS["kimi_k2"], tokenizer=tok), True)
    section = ids("<|tool_calls_section_begin|>") + ids("<|tool_call_begin|>functions.now:0")
    assert kimi(thought + section + ids(" more")) == len(thought)
    assert kimi(thought + ids("</think>") + ids(" answer")) == len(thought)
