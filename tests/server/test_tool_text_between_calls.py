"""Text a model writes between two tool calls (``<tool_call>…</tool_call>\\nnote\\n<tool_call>…``)
reaches a client the same, to the character, whether the answer is streamed or not: the newline
before the second call is part of the text, not whitespace trailing a call."""

from __future__ import annotations

import re
from pathlib import Path

import openai
import pytest

from server.chat_shape import ChoiceShaper, Shaped
from server.tool_parsers import ParsedCall, get_tool_parser
from server.tools import ToolPlan

A = ParsedCall("get_weather", '{"city": "Oslo"}')
B = ParsedCall("get_weather", '{"city": "Lima"}')
CALL_A = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
CALL_B = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def _stream(text: str) -> tuple[str, list[ParsedCall]]:
    """``text`` fed to hermes' streamer one character a delta (as a tiny vocabulary writes it)."""
    streamer = get_tool_parser("hermes").streamer()
    content, calls = "", []
    for char in text:
        piece, made = streamer.feed(char)
        content, calls = content + piece, calls + made
    piece, made = streamer.finish()
    return content + piece, calls + made


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (CALL_A + "\nmid\n" + CALL_B, "\nmid\n", [A, B]),
        (CALL_A + "\nmid\n", "\nmid\n", [A]),  # text after the last call keeps its own newline
        (CALL_A + "  \n" + CALL_B + "\n", "", [A, B]),  # whitespace alone between calls: nothing
        (CALL_A + "\n" + CALL_B + "ok", "ok", [A, B]),  # ... not even in front of text after the second
        (CALL_A + "\n<tool_call>x</tool_call>", "\n<tool_call>x</tool_call>", [A]),  # not a call: text
        (CALL_A + " x y\n\n" + CALL_B, " x y\n\n", [A, B]),
    ],
)
def test_text_between_calls_streams_as_parsed(text: str, content: str, calls: list[ParsedCall]) -> None:
    assert get_tool_parser("hermes").parse(text) == (content, calls)
    assert _stream(text) == (content, calls)


@pytest.fixture(scope="module")
def hermes_server(server_process, tiny_llama: Path, serve_logs: Path):
    srv = server_process(
        tiny_llama,
        ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--num-kv-blocks", "128"],
        serve_logs,
    ).start()
    yield srv
    srv.stop()


def test_served_stream_keeps_the_newline_before_a_second_call(hermes_server) -> None:
    client = openai.OpenAI(base_url=hermes_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    # The random model is steered into hermes' format with a regex; the parser reads it back.
    kw = {
        "model": hermes_server.model_name,
        "messages": [{"role": "user", "content": "Weather in Oslo and Lima?"}],
        "tools": TOOLS,
        "max_tokens": 400,  # the regex admits any split into tokens: some take many
        "seed": 0,
        "extra_body": {"structured_outputs": {"regex": re.escape(CALL_A + "\nmid\n" + CALL_B)}},
    }
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.message.content == "\nmid\n"
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == [
        ("get_weather", '{"city": "Oslo"}'),
        ("get_weather", '{"city": "Lima"}'),
    ]
    assert whole.finish_reason == "tool_calls"
    content, names = "", []
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            names += [c.function.name for c in choice.delta.tool_calls or []]
    assert content == "\nmid\n"
    assert names == ["get_weather", "get_weather"]


def _events(pieces: list[tuple[str, list[ParsedCall]]]) -> list[str | ParsedCall]:
    """Pieces as the answer's run of text and calls (adjacent text joined, empty text dropped)."""
    out: list[str | ParsedCall] = []
    for text, calls in pieces:
        if text and out and isinstance(out[-1], str):
            out[-1] += text
        elif text:
            out.append(text)
        out += calls
    return out


ORDERED = "Hi " + CALL_A + " mid" + CALL_B + " end"


@pytest.mark.parametrize("size", [1, 2, 3, 7, 20, len(CALL_A) + 5, len(ORDERED)])
def test_pieces_keep_text_after_a_call_after_it(size: int) -> None:
    """However many characters a delta holds (a slow client's merged deltas: the whole answer in
    one), the pieces give text and calls in the order written; ``feed`` joins them."""
    streamer = get_tool_parser("hermes").streamer()
    pieces = []
    for i in range(0, len(ORDERED), size):
        pieces += streamer.pieces(ORDERED[i : i + size])
    pieces.append(streamer.finish())
    assert _events(pieces) == ["Hi ", A, " mid", B, " end"]


def test_one_delta_holding_two_calls_is_three_pieces() -> None:
    streamer = get_tool_parser("hermes").streamer()
    assert streamer.pieces(ORDERED) == [("Hi ", [A]), (" mid", [B]), (" end", [])]
    assert get_tool_parser("hermes").streamer().feed(ORDERED) == ("Hi  mid end", [A, B])
    # Whitespace right after a call waits for text; with none in the delta, no piece follows.
    assert get_tool_parser("hermes").streamer().pieces("x" + CALL_A + "  ") == [("x", [A])]


def test_shaped_then_joins_pieces_in_order() -> None:
    shaper = ChoiceShaper(ToolPlan("auto", parser=get_tool_parser("hermes")), None)
    first = shaper.feed("Hi " + CALL_A + " mi")
    assert [(text, [c.function.name for c in calls]) for text, calls in first.pieces()] == [
        ("Hi ", ["get_weather"]),
        (" mi", []),
    ]
    both = first.then(shaper.feed("d" + CALL_B)).then(shaper.finish())
    assert (both.content, len(both.tool_calls)) == ("Hi  mid", 2)
    assert [(text, [c.index for c in calls]) for text, calls in both.pieces()] == [
        ("Hi ", [0]),
        (" mid", [1]),
    ]
    # Text that continues text, or a call right after a call, stays in its piece.
    assert Shaped("", "a").then(Shaped("", "b")).pieces() == [("ab", [])]
    call = both.tool_calls[0]
    assert Shaped("", "a", [call]).then(Shaped("", "", [call])).pieces() == [("a", [call, call])]
