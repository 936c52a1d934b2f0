"""Responses ``reasoning`` input items as chat messages (``server/responses_input.py``, which the
replica and the router's keyer both use): the thinking of the assistant turn that follows, as vLLM
passes it; the live prompts are checked against transformers in ``test_family_templates_serve.py``."""

from __future__ import annotations

import pytest

from server.responses_input import InputError, chat_messages

USER = {"role": "user", "content": "hi"}
CALL = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
OUTPUT = {"type": "function_call_output", "call_id": "c1", "output": "ok"}
CHAT_CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def thought(text: str) -> dict:
    return {
        "type": "reasoning",
        "id": "rs",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def test_a_thought_goes_with_the_turn_that_follows_it() -> None:
    said = {"type": "message", "role": "assistant", "content": "Sure."}
    assert chat_messages(None, [USER, thought("A"), said, CALL, OUTPUT, thought("B"), CALL]) == [
        USER,
        {"role": "assistant", "content": "Sure.", "reasoning_content": "A", "tool_calls": [CHAT_CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        {"role": "assistant", "content": None, "reasoning_content": "B", "tool_calls": [CHAT_CALL]},
    ]


def test_summaries_and_several_items_join_and_a_thought_with_no_turn_is_dropped() -> None:
    summary = {
        "type": "reasoning",
        "summary": [{"type": "summary_text", "text": "one"}, {"type": "summary_text", "text": "two"}],
    }
    assert chat_messages(None, [USER, thought("A"), summary, CALL]) == [
        USER,
        {"role": "assistant", "content": None, "reasoning_content": "Aone\n\ntwo", "tool_calls": [CHAT_CALL]},
    ]
    # Before a user message or at the end: no assistant turn of its own to render it with.
    assert chat_messages(None, [USER, thought("A"), USER, thought("B")]) == [USER, USER]
    encrypted = {"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}
    assert chat_messages(None, [USER, encrypted, CALL]) == [
        USER,
        {"role": "assistant", "content": None, "tool_calls": [CHAT_CALL]},
    ]


@pytest.mark.parametrize(
    ("item", "message"),
    [
        (
            {"type": "reasoning", "content": [{"type": "output_text", "text": "x"}]},
            "input[1].content must be a list of reasoning_text parts",
        ),
        ({"type": "reasoning", "content": "x"}, "input[1].content must be a list of reasoning_text parts"),
        (
            {"type": "reasoning", "summary": [{"type": "summary_text"}]},
            "input[1].summary must be a list of summary_text parts",
        ),
    ],
)
def test_a_malformed_thought_is_refused(item: dict, message: str) -> None:
    with pytest.raises(InputError) as e:
        chat_messages(None, [USER, item, CALL])
    assert (str(e.value), e.value.param) == (message, "input")
