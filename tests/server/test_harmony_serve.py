"""gpt-oss's harmony format through `ferry serve --reasoning-parser openai_gptoss --tool-call-parser
openai`: the analysis channel comes back as reasoning, a message to ``functions.NAME`` as a tool
call, whole or streamed. A regex constraint makes
the tiny model write harmony text, so the whole path (special tokens kept, split, parsed) runs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

HARMONY = (
    r"<\|channel\|>analysis<\|message\|>Look it up\.<\|end\|><\|start\|>assistant<\|channel\|>commentary "
    r'to=functions\.get_weather <\|constrain\|>json<\|message\|>\{"city": "Oslo"\}'
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def srv(tiny_llama: Path, serve_logs: Path, server_process) -> Iterator:
    flags = [
        "--reasoning-parser",
        "openai_gptoss",
        "--tool-call-parser",
        "openai",
        "--enable-auto-tool-choice",
    ]
    server = server_process(tiny_llama, [*flags, "--num-kv-blocks", "256"], serve_logs).start()
    yield server
    server.stop()


def _body(**extra) -> dict:
    return {
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "max_tokens": 400,
        "temperature": 0,
        "tools": TOOLS,
        "structured_outputs": {"regex": HARMONY},
        **extra,
    }


def test_analysis_is_reasoning_and_a_function_message_a_tool_call(srv) -> None:
    r = httpx.post(srv.url + "/v1/chat/completions", json=_body(), timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    message = choice["message"]
    assert message["reasoning_content"] == message["reasoning"] == "Look it up."  # vLLM's two names
    assert message["content"] is None
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]
    ] == [("get_weather", {"city": "Oslo"})]
    assert choice["finish_reason"] == "tool_calls"


def test_streamed_the_same(srv) -> None:
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=_body(stream=True), timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Look it up."
    assert [d.get("reasoning") for d in deltas] == [d.get("reasoning_content") for d in deltas]
    assert "".join(d.get("content") or "" for d in deltas) == ""
    calls = [t for d in deltas for t in d.get("tool_calls") or []]
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(t["function"].get("arguments") or "" for t in calls)) == {"city": "Oslo"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_thinking_budget_needs_think_markers(srv) -> None:
    # Harmony's channels have no <think> ... </think> to count and close: a budget is a 400 naming
    # the parser, not a cap silently ignored.
    r = httpx.post(srv.url + "/v1/chat/completions", json=_body(thinking_token_budget=5), timeout=60)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "thinking_token_budget"
    assert "--reasoning-parser openai_gptoss has no <think>" in r.json()["error"]["message"]


def test_responses_reasoning_tokens_are_the_analysis_and_commentary_tokens(srv, tiny_llama: Path) -> None:
    """Responses' usage.output_tokens_details.reasoning_tokens, as vLLM's HarmonyContext counts: the
    tokens of the analysis and commentary messages (the call's arguments too), each from its
    <|message|> to its body's end (not the headers, nor <|end|>), the same whole and streamed (the
    token ids decide)."""
    from transformers import AutoTokenizer

    chat = httpx.post(srv.url + "/v1/chat/completions", json=_body(return_token_ids=True), timeout=120).json()
    ids = chat["choices"][0]["token_ids"]
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    text = tok.decode(ids, skip_special_tokens=False)
    analysis = text.index("<|message|>Look it up.")
    call = text.index('<|message|>{"city"')
    spans = [(analysis, text.index("<|end|>")), (call, len(text))]  # the call's body runs to the end
    starts = [len(tok.decode(ids[:i], skip_special_tokens=False)) for i in range(len(ids))]
    expected = sum(any(a <= at < b for a, b in spans) for at in starts)
    in_analysis = sum(spans[0][0] <= at < spans[0][1] for at in starts)
    assert expected > in_analysis > 0
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
    body_r = {
        "input": "Weather in Oslo?",
        "max_output_tokens": 400,
        "temperature": 0,
        "tools": tools,
        "structured_outputs": {"regex": HARMONY},
    }
    whole = httpx.post(srv.url + "/v1/responses", json=body_r, timeout=120).json()
    assert whole["output"][0]["content"] == [{"type": "reasoning_text", "text": "Look it up."}]
    assert whole["usage"]["output_tokens_details"] == {"reasoning_tokens": expected}
    with httpx.stream("POST", srv.url + "/v1/responses", json={**body_r, "stream": True}, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[-1]["response"]["usage"] == whole["usage"]
