"""The tokens a streamed choice's content is given (``server/text_logprobs.py``), fed token by token
through the real shaper (hermes calls, qwen3 reasoning) as ``chat_stream`` feeds it: text held
back as a possible marker's start goes with the content it turns out to be, or is dropped with the
markup; a call's markup and the thinking give content no token. The Responses API's end-to-end
checks (whole, streamed, folded) are in ``test_folded_deltas_apis.py``."""

from __future__ import annotations

import re

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from server.chat_protocol import TokenLogprob
from server.chat_shape import ChoiceShaper
from server.reasoning_parsers import reasoning_splitter
from server.text_logprobs import TextLogprobs
from server.tool_parsers import get_tool_parser
from server.tools import ToolPlan

CALL = '{"name": "f", "arguments": {}}'


def _shown(
    tokens: list[str], tools: bool = True, reasoning: bool = False, numbered: bool = False
) -> list[tuple[str, list[str]]]:
    """(content, its tokens) of each content step, the tokens fed one at a time (the last one ends
    the answer); a token's logprob is named by its text (``numbered``: by its place)."""
    plan = ToolPlan("auto", parser=get_tool_parser("hermes")) if tools else None
    shaper = ChoiceShaper(plan, reasoning_splitter("qwen3") if reasoning else None)
    ledger = TextLogprobs()
    out = []
    for i, token in enumerate(tokens):
        final = i == len(tokens) - 1
        shaped = shaper.feed(token)
        if final:
            shaped = shaped.then(shaper.finish())
        steps = shaped.steps()
        name = str(i) if numbered else token
        given = ledger.step(token, [TokenLogprob(token=name, logprob=-1.0)], steps, shaper.held, final)
        out += [
            (text, [t.token for t in lps])
            for (_, text, _), lps in zip(steps, given, strict=True)
            if text or lps
        ]
    return out


def test_held_text_goes_with_its_release_and_markup_gives_none() -> None:
    tokens = ["Hi", " ", "<", "to", "ol", ">", " ", "<tool_call>", CALL, "</tool_call>", "\n", " ok"]
    assert _shown(tokens) == [
        ("Hi", ["Hi"]),
        (" ", [" "]),
        ("<tool>", ["<", "to", "ol", ">"]),  # held as a possible <tool_call>, then sent
        (" ", [" "]),
        ("\n ok", ["\n", " ok"]),  # whitespace after a call is held until text follows it
    ]


def test_a_held_start_that_becomes_a_call_is_dropped_and_whitespace_after_the_last_call_too() -> None:
    tokens = ["a", "<", "tool", "_call", ">", CALL, "</", "tool_call>", "\n", "\n"]
    assert _shown(tokens) == [("a", ["a"])]


def test_part_of_what_was_held_is_content() -> None:
    # "<" is held; the next token starts a call right after it: "<" alone is content.
    assert _shown(["x", "<", "<tool_call>", CALL, "</tool_call>"]) == [("x", ["x"]), ("<", ["<"])]


def test_text_after_a_call_in_the_same_token_gets_that_token() -> None:
    assert _shown(["<tool_call>", CALL, "</tool_call>ok", "!"]) == [("ok", ["</tool_call>ok"]), ("!", ["!"])]


def test_reasoning_gives_content_no_token() -> None:
    tokens = ["<think>", "hm", " <", "/", "think", ">", "\n\n", "Hel", "lo"]
    assert _shown(tokens, tools=False, reasoning=True) == [("Hel", ["Hel"]), ("lo", ["lo"])]


def test_reasoning_then_text_then_a_call() -> None:
    tokens = ["<think>", "a", "</think>", "Hi", " ", "<tool_call>", CALL, "</tool_call>"]
    assert _shown(tokens, reasoning=True) == [("Hi", ["Hi"]), (" ", [" "])]


def test_a_token_with_no_text_goes_with_the_character_that_completes_it() -> None:
    # A character's first bytes show no text until its last token; the ending token (EOS) has none.
    assert _shown(["a", "", "é", ""]) == [("a", ["a"]), ("é", ["", "é"])]


def test_a_resumed_stream_starts_where_the_shaper_is() -> None:
    shaper = ChoiceShaper(ToolPlan("auto", parser=get_tool_parser("hermes")), None)
    shaper.skip("Hi <to")  # "<to" is held
    ledger = TextLogprobs("Hi <to", shaper.held)
    shaped = shaper.feed("ol>")
    given = ledger.step("ol>", [TokenLogprob(token="ol>", logprob=-1.0)], shaped.steps(), shaper.held, False)
    assert shaped.content == "<tool>" and [[t.token for t in lps] for lps in given] == [["ol>"]]


def test_a_token_part_dropped_newline_part_content_goes_with_the_content() -> None:
    # The newlines after </think> are dropped, not content: "\n " gives content " ", and its token.
    tokens = ["<think>", "<", "</think>", "\n "]
    assert _shown(tokens, reasoning=True) == [(" ", ["\n "])]


def test_a_thought_released_with_content_keeps_its_token() -> None:
    # "<" is held as a possible </think>; the next token releases it as thinking and writes the
    # content "<" before a call: the content's token is that one, not the thinking's "<".
    tokens = ["<think>", "<", "/x</think><<tool_call>" + CALL + "</tool_call>", "z"]
    assert _shown(tokens, reasoning=True) == [("<", [tokens[2]]), ("z", ["z"])]


def test_whitespace_between_two_calls_is_dropped_not_carried_past_the_second() -> None:
    call = "<tool_call>" + CALL + "</tool_call>"
    assert _shown([call, "\n", call, "ba"]) == [("ba", ["ba"])]


_TEXT = st.text(alphabet="ab<>/ \n", min_size=1, max_size=6)


def _parts(draw: st.DrawFn) -> tuple[list[str], bool]:
    """An answer's parts: optional thinking, then text and calls."""
    reasoning = draw(st.booleans())
    parts = ["<think>", draw(_TEXT), "</think>"] if reasoning else []
    for _ in range(draw(st.integers(1, 5))):
        parts.append(draw(st.sampled_from(["<tool_call>" + CALL + "</tool_call>", "text"])))
        if parts[-1] == "text":
            parts[-1] = draw(_TEXT)
    return parts, reasoning


@st.composite
def _answers(draw: st.DrawFn) -> tuple[list[str], bool]:
    """An answer cut into tokens: no token crosses from one part to the next, nor from newlines to
    other characters (a token part markup or part dropped newlines, part content, is the one case
    the ledger gives content a token's extra text: ``_anyhow_cut`` has those)."""
    parts, reasoning = _parts(draw)
    tokens = []
    for part in parts:
        runs = [m.group() for m in re.finditer(r"\n+| +|[^ \n]+", part)]
        for run in runs:
            cuts = sorted(draw(st.sets(st.integers(1, max(1, len(run) - 1)), max_size=3)))
            bounds = [0, *(c for c in cuts if c < len(run)), len(run)]
            tokens += [run[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    return tokens, reasoning


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_answers())
@example((["<think>", "<", "</think>", "\n", " "], True))
@example((["<tool_call>" + CALL + "</tool_call>", "\n", "<tool_call>" + CALL + "</tool_call>", "ba"], False))
def test_content_gets_exactly_its_tokens_however_an_answer_is_cut(answer) -> None:
    tokens, reasoning = answer
    shown = _shown(tokens, reasoning=reasoning)
    assert "".join(t for _, lps in shown for t in lps) == "".join(text for text, _ in shown)


@st.composite
def _anyhow_cut(draw: st.DrawFn) -> tuple[list[str], bool]:
    """An answer cut into tokens anywhere, each marker a token of its own (a special token in the
    models that write it): a token may cross from dropped newlines or whitespace to content
    (``\n `` after ``</think>``, `` \nx`` after a call)."""
    parts, reasoning = _parts(draw)
    text = "".join(parts)
    markers = [m.span() for m in re.finditer(r"</?think>|</?tool_call>", text)]
    cuts = draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=len(text) // 2))
    cuts |= {at for span in markers for at in span}
    inside = {at for a, b in markers for at in range(a + 1, b)}
    bounds = [0, *sorted(c for c in cuts if 0 < c < len(text) and c not in inside), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)], reasoning


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_anyhow_cut())
@example((["<think>", "<", "</think>", "\n "], True))
@example((["<think>", "<", "/x</think><<tool_call>" + CALL + "</tool_call>", "z"], True))
@example((["<think><<", "/think><"], True))  # the held "<" is markup: the content "<" is the last one
def test_a_token_goes_with_content_when_any_of_its_characters_does(answer) -> None:
    """The same answer fed a character a token (no token is then part content, part not) names the
    characters that are content; cut anyhow, content gets exactly the tokens with one of them."""
    tokens, reasoning = answer
    text = "".join(tokens)
    by_char = _shown(list(text), reasoning=reasoning, numbered=True)
    content = "".join(piece for piece, _ in by_char)
    kept = [int(n) for _, lps in by_char for n in lps]
    assert "".join(text[i] for i in kept) == content
    shown = _shown(tokens, reasoning=reasoning, numbered=True)
    starts = [sum(map(len, tokens[:i])) for i in range(len(tokens) + 1)]
    expected = [i for i in range(len(tokens)) if any(starts[i] <= k < starts[i + 1] for k in kept)]
    assert "".join(piece for piece, _ in shown) == content
    assert [int(n) for _, lps in shown for n in lps] == expected
