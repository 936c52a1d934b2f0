"""Answers for the folded-delta tests (``test_folded_deltas.py``, ``test_folded_deltas_apis.py``):
the answers a regex steers the random model to, what each API shows of them, and readers that put
a stream's chunks or events and a whole answer in one shape to compare."""

from __future__ import annotations

import json
from typing import Any

import httpx

from server.config import ServerConfig

# None: the whole answer in one delta; 0: as the engine gives them (token by token here).
FOLDS = [0, 2, None]


def regex(text: str) -> str:
    return "".join("\\" + c if c in "\\.^$|?*+()[]{}" else c for c in text)


async def sse(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], **more: Any
) -> list[dict[str, Any]]:
    """The JSON of each ``data:`` line of ``body``'s streamed answer (``[DONE]`` left out)."""
    out = []
    async with client.stream("POST", path, json={**body, "stream": True, **more}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                out.append(json.loads(line[6:]))
    return out


TEXT = "Hello world, all is well"


class Thought(str):
    """Reasoning text (``reasoning_content``) in an answer's order written."""


CALL_F = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
CALL_G = '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}
    for name in "fg"
]
F, G = ("f", '{"a": 1}'), ("g", "{}")
# gpt-oss's harmony: a thought, a preamble to the user, another thought, a call.
HARMONY = (
    "<|channel|>analysis<|message|>Think A.<|end|><|start|>assistant<|channel|>commentary<|message|>"
    "Preamble.<|end|><|start|>assistant<|channel|>analysis<|message|>Think B.<|end|>"
    '<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": 1}'
)
# (server flags, answer, its reasoning, content and calls in the order written)
CHAT_CASES = {
    "plain": ({}, TEXT, [TEXT]),
    "tools": ({"tools": "hermes"}, "Hello " + CALL_F + " after" + CALL_G + " end",
              ["Hello ", F, " after", G, " end"]),
    "reasoning": ({"reasoning": "qwen3"}, "<think>Let me see.</think>Hello there",
                  [Thought("Let me see."), "Hello there"]),
    # Text held back as a possible marker's start ("<" in the thinking, "<tool" in the answer) goes
    # on where it turns out not to be one; whitespace after the last call is dropped.
    "both": ({"tools": "hermes", "reasoning": "qwen3"},
             "<think>hm <</think>Hi <tool> " + CALL_F + " mid" + CALL_G + "\n",
             [Thought("hm <"), "Hi <tool> ", F, " mid", G]),
    "harmony": ({"tools": "openai", "reasoning": "openai_gptoss"}, HARMONY,
                [Thought("Think A."), "Preamble.", Thought("Think B."), F]),
}  # fmt: skip


def chat_config(tools: str | None = None, reasoning: str | None = None) -> ServerConfig:
    return ServerConfig(
        served_model_name="m",
        enable_auto_tool_choice=tools is not None,
        tool_call_parser=tools,
        reasoning_parser=reasoning,
    )


def written(pieces: list[Any]) -> list[Any]:
    """Thoughts, text and calls in the order written, adjacent ones of a kind joined, empty ones
    dropped."""
    out: list[Any] = []
    for piece in pieces:
        if isinstance(piece, str) and out and type(out[-1]) is type(piece):
            out[-1] = type(piece)(out[-1] + piece)
        elif piece:
            out.append(piece)
    return out


def chat_streamed(chunks: list[dict[str, Any]], n: int) -> dict[str, Any]:
    choices: list[dict[str, Any]] = [
        {"written": [], "finish_reason": None, "stop_reason": None, "tokens": []} for _ in range(n)
    ]
    args: dict[tuple[int, int], list[str]] = {}
    usage = None
    for c in chunks:
        usage = c.get("usage") or usage
        for ch in c["choices"]:
            mine, delta = choices[ch["index"]], ch["delta"]
            mine["written"].append(Thought(delta.get("reasoning_content") or ""))
            mine["written"].append(delta.get("content") or "")
            for call in delta.get("tool_calls") or []:
                key = (ch["index"], call["index"])
                if key not in args:
                    args[key] = [call["function"]["name"]]
                    mine["written"].append(args[key])
                args[key].append(call["function"].get("arguments") or "")
            if ch["finish_reason"] is not None:
                mine["finish_reason"], mine["stop_reason"] = ch["finish_reason"], ch.get("stop_reason")
            if ch.get("logprobs"):
                mine["tokens"] += [t["token"] for t in ch["logprobs"]["content"]]
    for mine in choices:
        pieces = [p if isinstance(p, str) else (p[0], "".join(p[1:])) for p in mine["written"]]
        mine["written"] = written(pieces)
    return {"choices": choices, "usage": usage}


def chat_whole(body: dict[str, Any]) -> dict[str, Any]:
    choices = []
    for ch in sorted(body["choices"], key=lambda ch: ch["index"]):
        message = ch["message"]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
        choices.append(
            {
                "reasoning": message.get("reasoning_content"),
                "content": message.get("content"),
                "calls": calls,
                "finish_reason": ch["finish_reason"],
                "stop_reason": ch.get("stop_reason"),
                "tokens": [t["token"] for t in (ch.get("logprobs") or {}).get("content") or []],
            }
        )
    return {"choices": choices, "usage": body["usage"]}


def response_items(output: list[dict[str, Any]]) -> list[tuple]:
    shape = []
    for item in output:
        if item["type"] == "message":
            part = item["content"][0]
            shape.append(("message", part["text"], [t["token"] for t in part["logprobs"]]))
        elif item["type"] == "reasoning":
            shape.append(("reasoning", item["content"][0]["text"]))
        else:
            shape.append((item["name"], item["arguments"]))
    return shape


def message_of_events(events: list[dict[str, Any]]) -> dict[str, Any]:
    """A Messages stream's events read as the whole message's content, stop reason and usage."""
    blocks: list[dict[str, Any]] = []
    message: dict[str, Any] = {}
    for e in events:
        if e["type"] == "message_start":
            message = e["message"]
        elif e["type"] == "content_block_start":
            blocks.append({**e["content_block"], "partial": ""})
        elif e["type"] == "content_block_delta":
            d, block = e["delta"], blocks[e["index"]]
            field = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial"}[
                d["type"]
            ]
            block[field] += d["partial_json" if field == "partial" else field]
        elif e["type"] == "message_delta":
            message = {**message, **e["delta"], "usage": {**message["usage"], **e["usage"]}}
    for block in blocks:
        partial = block.pop("partial")
        if block["type"] == "tool_use":
            block["input"] = json.loads(partial)
    return {**message, "content": blocks}


def message_blocks(message: dict[str, Any]) -> list[tuple]:
    return [
        (b["type"], b.get("text", b.get("thinking")))
        if b["type"] != "tool_use"
        else (b["name"], json.dumps(b["input"]))
        for b in message["content"]
    ]
