"""A reasoning model with structured outputs and tool calls, as vLLM serves one: the constraint
waits for the end of thinking (``</think>``, one token here as in DeepSeek-R1 and Qwen3), so the
thoughts are free text in ``reasoning_content`` and the answer after them follows the schema.

The model is a tiny random Llama whose tokenizer has ``<think>`` and ``</think>``; a small
logit_bias on ``</think>`` makes the greedy model think for a few tokens and then stop."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from engine.demo import build_model
from engine.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "c": {"enum": ["x", "y"]}},
    "required": ["ok", "c"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def reasoner(models_root: Path) -> Path:
    return build_model(models_root / "reasoner", "llama", seed=5, extra_tokens=("<think>", "</think>"))


@pytest.fixture(scope="module")
def end_id(reasoner: Path) -> int:
    (end,) = Tokenizer.from_dir(reasoner).encode("</think>", add_special_tokens=False)
    return end


@pytest.fixture(scope="module")
def srv(server_process, reasoner: Path, serve_logs: Path):
    args = ["--reasoning-parser", "deepseek_r1", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    proc = server_process(reasoner, args, serve_logs).start()
    yield proc
    proc.stop()


def _post(srv, body: dict) -> dict:
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": MESSAGES, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(srv, body: dict) -> tuple[str, str, list, str]:
    reasoning = content = ""
    calls: list = []
    finish = None
    with httpx.stream(
        "POST",
        srv.url + "/v1/chat/completions",
        json={"messages": MESSAGES, **body, "stream": True},
        timeout=60,
    ) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                reasoning += c["delta"].get("reasoning_content") or ""
                content += c["delta"].get("content") or ""
                calls += c["delta"].get("tool_calls") or []
                finish = c.get("finish_reason") or finish
    return reasoning, content, calls, finish


def test_the_schema_holds_after_free_thinking(srv, end_id) -> None:
    body = {
        "max_tokens": 60,
        "temperature": 0,
        "logit_bias": {str(end_id): 1.0},
        "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True},
        "return_token_ids": True,
    }
    choice = _post(srv, body)["choices"][0]
    reasoning, content = choice["message"]["reasoning_content"], choice["message"]["content"]
    ids = choice["token_ids"]
    # Thoughts first (unconstrained: not JSON), then </think>, then the answer in the schema.
    assert ids.count(end_id) == 1 and ids.index(end_id) >= 3
    assert reasoning and not reasoning.lstrip().startswith("{")
    value = json.loads(content)
    assert list(value) == ["ok", "c"] and isinstance(value["ok"], bool) and value["c"] in ("x", "y")
    assert choice["finish_reason"] == "stop"
    assert _stream(srv, body)[:2] == (reasoning, content)


def test_without_the_end_of_thinking_nothing_is_constrained(srv, end_id) -> None:
    body = {
        "max_tokens": 30,
        "temperature": 0,
        "logit_bias": {str(end_id): -100.0},
        "response_format": {"type": "json_object"},
    }
    choice = _post(srv, body)["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    assert choice["message"]["reasoning_content"]


def test_a_named_tool_call_after_thinking(srv, end_id) -> None:
    tools = [{"type": "function", "function": {"name": "pick", "parameters": SCHEMA}}]
    body = {
        "max_tokens": 60,
        "temperature": 0,
        "logit_bias": {str(end_id): 1.0},
        "tools": tools,
        "tool_choice": {"type": "function", "function": {"name": "pick"}},
    }
    message = _post(srv, body)["choices"][0]["message"]
    assert message["reasoning_content"] and message["content"] is None
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "pick"
    assert set(json.loads(call["function"]["arguments"])) == {"ok", "c"}
    reasoning, content, calls, finish = _stream(srv, body)
    assert (reasoning, content, finish) == (message["reasoning_content"], "", "stop")
    assert "".join(c["function"].get("arguments") or "" for c in calls) == call["function"]["arguments"]


def test_responses_api_gives_a_reasoning_item_then_the_message(srv, end_id) -> None:
    body = {
        "input": "hi",
        "max_output_tokens": 60,
        "temperature": 0,
        "logit_bias": {str(end_id): 1.0},
        "text": {"format": {"type": "json_schema", "name": "pick", "schema": SCHEMA}},
    }
    r = httpx.post(srv.url + "/v1/responses", json=body, timeout=60).json()
    reasoning, message = r["output"]
    assert reasoning["type"] == "reasoning" and reasoning["content"][0]["text"]
    # (JSON with optional whitespace, which this random model fills up to the limit: compared below.)
    assert message["type"] == "message" and message["content"][0]["text"].startswith("{")
    chat = _post(
        srv,
        {
            "max_tokens": 60,
            "temperature": 0,
            "logit_bias": {str(end_id): 1.0},
            "response_format": {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA}},
        },
    )
    assert reasoning["content"][0]["text"] == chat["choices"][0]["message"]["reasoning_content"]
    assert message["content"][0]["text"] == chat["choices"][0]["message"]["content"]


# DeepSeek-V3.1's switch, in miniature: the prompt opens the thinking only when asked to.
V31_TEMPLATE = (
    "{% for m in messages %}{{ m.content }}{% endfor %}{% if thinking %}<think>{% else %}</think>{% endif %}"
)


def test_deepseek_v3_parser_follows_the_prompts_thinking_switch(
    server_process, reasoner: Path, serve_logs: Path, end_id: int, tmp_path: Path
) -> None:
    template = tmp_path / "v31.jinja"
    template.write_text(V31_TEMPLATE)
    args = ["--reasoning-parser", "deepseek_v3", "--chat-template", str(template)]
    proc = server_process(reasoner, args, serve_logs).start()
    try:
        body = {"max_tokens": 12, "temperature": 0, "logit_bias": {str(end_id): -100.0}, "ignore_eos": True}
        thinking = _post(proc, {**body, "chat_template_kwargs": {"thinking": True}})["choices"][0]["message"]
        plain = _post(proc, {**body, "chat_template_kwargs": {"thinking": False}})["choices"][0]["message"]
        default = _post(proc, body)["choices"][0]["message"]
    finally:
        proc.stop()
    # The same greedy tokens each time (the prompts differ in one tag): read as unfinished thoughts
    # after "<think>", as the answer after "</think>".
    assert thinking["reasoning_content"] and thinking["content"] is None
    assert plain.get("reasoning_content") is None and plain["content"]
    assert default == plain
