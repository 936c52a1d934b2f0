"""Streaming tool calls cut into deltas of every small size (what tokenizers make of markers: one to a
few characters a token), for every format's cases, gives the whole answer's result; and a call whose
arguments are a long text (a file written through a tool, a few characters a delta) is read in time
proportional to its length."""

from __future__ import annotations

import json
import time

import pytest

from server.tool_parsers import ParsedCall, get_tool_parser
from server.tools import ChoiceTools, ToolPlan
from tests.server.test_tool_parsers import ALL


def _stream(parser: str, text: str, size: int) -> tuple[str, list[ParsedCall]]:
    streamer = get_tool_parser(parser).streamer()
    content, calls = "", []
    for i in range(0, len(text), size):
        piece, made = streamer.feed(text[i : i + size])
        content, calls = content + piece, calls + made
    piece, made = streamer.finish()
    return content + piece, calls + made


@pytest.mark.parametrize(("parser", "text", "content", "calls"), ALL)
def test_every_delta_size(parser, text, content, calls) -> None:
    for size in range(1, 17):
        assert _stream(parser, text, size) == (content, calls), size


def _stream_required(text: str) -> tuple[str, list[ParsedCall]]:
    tools = ChoiceTools(ToolPlan("required"))
    for char in text:
        tools.feed(char)
    content, deltas = tools.finish()
    return content, [ParsedCall(d.function.name, d.function.arguments) for d in deltas]


@pytest.mark.parametrize(
    ("kind", "repeat"),
    [
        # Every marked format (hermes, qwen3_coder, glm45, deepseek, kimi_k2, openai) reads calls
        # with hermes' streamer; llama3_json the whole-answer formats' (pythonic, granite, …).
        ("hermes", 32_000),
        ("llama3_json", 100_000),
        ("required", 100_000),
    ],
)
def test_long_arguments_stream_in_linear_time(kind: str, repeat: int) -> None:
    file = "print('hello')\n" * repeat  # 0.5 to 1.5 MB, one character a delta
    args = json.dumps({"text": file})
    text = {
        "hermes": '<tool_call>{"name": "write", "arguments": ' + args + "}</tool_call>",
        "llama3_json": '{"name": "write", "parameters": ' + args + "}",
        "required": '[{"name": "write", "parameters": ' + args + "}]",
    }[kind]
    start = time.process_time()
    content, calls = _stream_required(text) if kind == "required" else _stream(kind, text, 1)
    elapsed = time.process_time() - start
    assert (content, calls) == ("", [ParsedCall("write", args)])
    # Linear: about half a second of CPU here. Joining the text so far at every delta (quadratic)
    # took 30 s to 2 minutes; the bound leaves a wide margin for a slow, loaded machine.
    assert elapsed < 10.0
