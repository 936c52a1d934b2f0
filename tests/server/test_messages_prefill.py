"""Anthropic's prefill on ``POST /v1/messages``: a conversation that ends in the assistant's text is
continued from that text (not answered by a new assistant turn), driven by the ``anthropic`` SDK."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import pytest

from tests.server.test_messages_api import TEMPLATE

PREFILL = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "My answer is"}]
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def srv(tiny_llama: Path, serve_logs: Path, server_process, tmp_path_factory) -> Iterator:
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    server = server_process(tiny_llama, ["--chat-template", str(template)], serve_logs).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(srv) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0, timeout=60)


def _post(srv, path: str, body: dict) -> dict:
    r = httpx.post(srv.url + path, json={"model": srv.model_name, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("content", ["My answer is", [{"type": "text", "text": "My answer is"}]])
def test_final_assistant_text_is_continued(srv, client, content) -> None:
    messages = [PREFILL[0], {"role": "assistant", "content": content}]
    continued = {"messages": PREFILL, "continue_final_message": True, "add_generation_prompt": False}
    tokens = _post(srv, "/tokenize", continued)["tokens"]
    prompt = httpx.post(srv.url + "/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert prompt.endswith("My answer is")  # no new assistant turn after the prefill
    counted = client.messages.count_tokens(model=srv.model_name, messages=messages)
    assert counted.input_tokens == len(tokens)
    chat = _post(srv, "/v1/chat/completions", {**continued, "max_tokens": 6, **GREEDY})
    m = client.messages.create(model=srv.model_name, max_tokens=6, messages=messages, extra_body=GREEDY)
    assert m.content[0].text == chat["choices"][0]["message"]["content"]
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(tokens)
    with client.messages.stream(
        model=srv.model_name, max_tokens=6, messages=messages, extra_body=GREEDY
    ) as stream:
        assert stream.get_final_message().content[0].text == m.content[0].text


def test_assistant_tool_use_last_is_not_a_prefill(srv, client) -> None:
    # A turn that ends in a call is not text to continue: the prompt still opens a new turn.
    messages = [
        PREFILL[0],
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
    ]
    counted = client.messages.count_tokens(model=srv.model_name, messages=messages)
    chat = [
        {"role": "user", "content": "Name a color."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
    ]
    assert counted.input_tokens == _post(srv, "/tokenize", {"messages": chat})["count"]
