"""A cap on an ``auto`` answer's tool calls (the Responses API's ``max_tool_calls``) at the level of
the stream's text: ``ChoiceTools`` keeps the calls up to the cap and says when the answer can stop,
and ``cut_at_cap`` finds the token that completed the last call allowed inside a delta of several
tokens (the engine batches the tokens generated while the server was busy), so the answer and its
usage end there however the tokens were batched. Real tiny_llama tokenizer, real Hermes parser."""

from __future__ import annotations

from engine.sampling_params import SamplingParams
from server.chat_cap import cut_at_cap
from server.chat_shape import ChoiceShaper
from server.sequence_request import SequenceRequest
from server.tool_parsers import get_tool_parser
from server.tools import ChoiceTools, ToolPlan

CALL = '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
TEXT = "Sure\n" + CALL + "\n" + CALL + "\nDone"


def _plan(cap: int | None) -> ToolPlan:
    return ToolPlan("auto", parser=get_tool_parser("hermes"), max_calls=cap)


def test_choice_tools_are_capped_once_the_last_call_allowed_is_complete() -> None:
    tools = ChoiceTools(_plan(1))
    assert tools.feed("Sure\n" + CALL[:-1]) == ("Sure\n", []) and not tools.capped
    _, calls = tools.feed(CALL[-1:])
    assert [c.function.name for c in calls] == ["now"] and tools.capped
    _, calls = tools.feed("\n" + CALL)
    assert calls == [] and tools.count == 1  # past the cap: dropped
    uncapped = ChoiceTools(_plan(None))
    assert len(uncapped.feed(TEXT)[1]) == 2 and not uncapped.capped


def test_a_cap_of_zero_is_reached_by_the_first_call_written() -> None:
    tools = ChoiceTools(_plan(0))
    assert tools.feed("Sure\n") == ("Sure\n", []) and not tools.capped
    assert tools.feed(CALL) == ("", []) and tools.capped and not tools.made_calls


def test_whole_answers_keep_the_calls_up_to_the_cap() -> None:
    assert [len(_plan(cap).read(TEXT)[1]) for cap in (0, 1, 2, 3, None)] == [0, 1, 2, 2, 2]


def test_cut_at_cap_keeps_the_tokens_through_the_last_call(tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    # The first call is complete at the first token whose text ends "</tool_call>".
    through = next(k for k in range(1, len(ids) + 1) if "</tool_call>" in tokenizer.decode(ids[:k]))
    seq = SequenceRequest(0, 0, tokenizer.encode("Go", add_special_tokens=False), SamplingParams())
    for start in range(max(1, through - 4), through):  # a delta that starts before the call ends
        kept, shaped, shaper = cut_at_cap(
            tokenizer, seq, lambda: ChoiceShaper(_plan(1), None), ids[:start], ids[start:]
        )
        assert kept == through - start, start
        assert [c.function.name for c in shaped.tool_calls] == ["now"]
        assert shaped.content == "" and shaper.capped and shaper.made_calls
    # A delta in which the cap is never reached is kept whole.
    kept, shaped, shaper = cut_at_cap(tokenizer, seq, lambda: ChoiceShaper(_plan(5), None), ids[:3], ids[3:])
    assert kept == len(ids) - 3 and len(shaped.tool_calls) == 2 and not shaper.capped
