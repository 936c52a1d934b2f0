"""Text a model writes between two tool calls (``<tool_call>…</tool_call>\\nnote\\n<tool_call>…``)
reaches a client the same, to the character, whether the answer is streamed or not: the newline
before the second call is part of the text, not whitespace trailing a call."""

from __future__ import annotations

import re
from pathlib import Path

import openai
import pytest

from server.tool_parsers import ParsedCall, get_tool_parser

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
