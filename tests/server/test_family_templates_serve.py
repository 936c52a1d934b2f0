"""A live replica renders real families' chat templates as transformers does (``/tokenize`` and a
chat's ``usage.prompt_tokens``), and the router's ``TokenKeyer`` gives the same token ids: an
assistant's earlier reasoning, empty tool-call arguments, DeepSeek's concatenated arguments, a
trimming template's ``continue_final_message``, vLLM's ``documents``. A template that raises is a
400 with its message, a stream's too.

Earlier thinking sent back through the other APIs reaches the template as the assistant turn's
``reasoning_content`` (as vLLM passes it), on the replica and in the router's keys alike: a
Responses ``reasoning`` item (its ``reasoning_text`` content, else its summary) goes with the
assistant text and calls that follow it, replayed or stored (``previous_response_id``); Anthropic
``thinking`` blocks are their turn's, ``redacted_thinking`` ones are taken and dropped."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from family_chat_templates import DEEPSEEK_R1, MIXTRAL, QWEN3
from family_template_cases import CALL, CASES, TOOLS, USER, hf_ids

from router.prompt_keys import TokenKeyer, messages_as_chat, responses_as_chat


@pytest.fixture(scope="module")
def qwen3_model(tiny_qwen2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_qwen2 carrying Qwen3's template, and DeepSeek-R1's as a named one."""
    model = tmp_path_factory.mktemp("qwen3") / "qwen3-tpl"
    shutil.copytree(tiny_qwen2, model)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": QWEN3},
        {"name": "deepseek", "template": DEEPSEEK_R1},
        {"name": "rag", "template": RAG},
        {"name": "mixtral", "template": MIXTRAL},
    ]
    (model / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    return model


@pytest.fixture(scope="module")
def qwen3_server(qwen3_model: Path, serve_logs: Path, server_process) -> Iterator:
    srv = server_process(
        qwen3_model,
        ["--num-kv-blocks", "64", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
        serve_logs,
    ).start()
    yield srv
    srv.stop()


# Documents as RAG templates (Command-R, Granite) take them: the template's ``documents``; it
# trims messages, as Gemma's and Llama 3.1's do.
RAG = (
    "{% for d in documents %}<doc title={{ d.title }}>{{ d.text }}</doc>\n{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DOCUMENTS = [{"title": "Paris", "text": "Sunny, 22C."}, {"title": "Lyon", "text": "Rain."}]

LIVE = {
    "reasoning_in_history": CASES["reasoning_in_history"],
    "empty_arguments": CASES["empty_arguments"],
    "deepseek_tool_history": {**CASES["tool_history"], "chat_template_kwargs": {"chat_template": "deepseek"}},
    "continue_trailing_space": {
        **CASES["continue_trailing_space"],
        "chat_template_kwargs": {"chat_template": "rag"},
        "documents": DOCUMENTS,
    },
    "documents": {
        "messages": [USER],
        "documents": DOCUMENTS,
        "chat_template_kwargs": {"chat_template": "rag"},
    },
}


@pytest.mark.parametrize("case", list(LIVE))
def test_replica_and_router_render_as_transformers(qwen3_server, qwen3_model: Path, case: str) -> None:
    from transformers import PreTrainedTokenizerFast

    body = LIVE[case]
    hf = PreTrainedTokenizerFast.from_pretrained(str(qwen3_model))
    template = body.get("chat_template_kwargs", {}).get("chat_template")
    own = {"deepseek": DEEPSEEK_R1, "rag": RAG}.get(template)
    want = hf_ids(
        hf,
        {**body, "chat_template_kwargs": {"chat_template": own}} if own else body,
        decode_arguments=template != "deepseek",
    )
    model = qwen3_server.model_name
    got = httpx.post(qwen3_server.url + "/tokenize", json={"model": model, **body}, timeout=30).json()
    assert got["tokens"] == want
    answer = httpx.post(
        qwen3_server.url + "/v1/chat/completions",
        json={"model": model, **body, "max_tokens": 1, "temperature": 0},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["prompt_tokens"] == len(want)
    keyer = TokenKeyer.from_dir(str(qwen3_model), 16)
    assert keyer.token_ids("/v1/chat/completions", {"model": model, **body}) == want


@pytest.mark.parametrize("stream", [False, True])
def test_a_template_that_raises_is_a_400_with_its_message(qwen3_server, stream: bool) -> None:
    """Mixtral's template refuses a system message: the client gets a 400 carrying the template's
    own words (a stream is refused before it starts), on chat and on /tokenize."""
    body = {
        "model": qwen3_server.model_name,
        "messages": [{"role": "system", "content": "Be brief."}, USER],
        "chat_template_kwargs": {"chat_template": "mixtral"},
    }
    for path, extra in (("/v1/chat/completions", {"stream": stream, "max_tokens": 2}), ("/tokenize", {})):
        answer = httpx.post(qwen3_server.url + path, json={**body, **extra}, timeout=60)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["message"] == (
            "chat template error: Conversation roles must alternate user/assistant/user/assistant/..."
        )
        assert error["param"] == "messages"


THOUGHT = "I should call the tool."
# The messages a tool loop with earlier thinking is (Qwen3's template renders the thought: the turn
# comes after the last user message).
THINKING_LOOP = [
    USER,
    {
        "role": "assistant",
        "content": "Let me check.",
        "reasoning_content": THOUGHT,
        "tool_calls": [{**CALL[0], "function": {**CALL[0]["function"], "arguments": '{"city": "Paris"}'}}],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "22C"},
]
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
REASONING_ITEMS = {
    "content": {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": THOUGHT}],
    },
    "summary": {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": THOUGHT}]},
}


def _loop_items(reasoning: dict | None) -> list[dict]:
    """THINKING_LOOP as a client replays a response's output items in a Responses tool loop."""
    said = {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "Let me check."}],
    }
    call = {
        "type": "function_call",
        "call_id": "call_1",
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
    }
    return [
        USER,
        *([reasoning] if reasoning else []),
        said,
        call,
        {"type": "function_call_output", "call_id": "call_1", "output": "22C"},
    ]


def _input_tokens(server, body: dict) -> int:
    answer = httpx.post(
        server.url + "/v1/responses",
        json={"model": server.model_name, "max_output_tokens": 16, "temperature": 0, **body},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    return answer.json()["usage"]["input_tokens"]


@pytest.mark.parametrize("form", list(REASONING_ITEMS))
def test_responses_reasoning_items_reach_the_template(qwen3_server, qwen3_model: Path, form: str) -> None:
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(str(qwen3_model))
    want = hf_ids(hf, {"messages": THINKING_LOOP, "tools": TOOLS})
    body = {
        "model": qwen3_server.model_name,
        "input": _loop_items(REASONING_ITEMS[form]),
        "tools": RESPONSES_TOOLS,
    }
    assert _input_tokens(qwen3_server, body) == len(want)
    keyer = TokenKeyer.from_dir(str(qwen3_model), 16)
    assert keyer.token_ids("/v1/chat/completions", responses_as_chat(body)) == want
    assert keyer.keys("/v1/responses", body)[1] == len(want)
    # Encrypted reasoning (OpenAI's) has no text here: the turn as if it had none.
    encrypted = {"type": "reasoning", "id": "rs_2", "summary": [], "encrypted_content": "gAAA"}
    plain = _input_tokens(qwen3_server, {**body, "input": _loop_items(None)})
    assert _input_tokens(qwen3_server, {**body, "input": _loop_items(encrypted)}) == plain < len(want)


def test_a_stored_reasoning_item_renders_as_a_replayed_one(qwen3_server) -> None:
    """previous_response_id: the stored input's reasoning item reaches the template as it does
    when the client replays the same items."""
    items = _loop_items(REASONING_ITEMS["content"])
    first = httpx.post(
        qwen3_server.url + "/v1/responses",
        json={
            "model": qwen3_server.model_name,
            "input": items[:-1],
            "tools": RESPONSES_TOOLS,
            "max_output_tokens": 16,
        },
        timeout=60,
    ).json()
    then = {"tools": RESPONSES_TOOLS}
    stored = _input_tokens(qwen3_server, {**then, "previous_response_id": first["id"], "input": items[-1:]})
    replayed = _input_tokens(qwen3_server, {**then, "input": items[:-1] + first["output"] + items[-1:]})
    without = _input_tokens(
        qwen3_server, {**then, "input": items[:1] + items[2:-1] + first["output"] + items[-1:]}
    )
    assert stored == replayed > without


def test_anthropic_thinking_blocks_reach_the_template(qwen3_server, qwen3_model: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(str(qwen3_model))
    want = hf_ids(hf, {"messages": THINKING_LOOP, "tools": TOOLS})
    function = TOOLS[0]["function"]
    body = {
        "model": qwen3_server.model_name,
        "max_tokens": 1,
        "tools": [
            {
                "name": function["name"],
                "description": function["description"],
                "input_schema": function["parameters"],
            }
        ],
        "messages": [
            USER,
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "I should ", "signature": "c2ln"},
                    {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix"},
                    {"type": "thinking", "thinking": "call the tool.", "signature": "c2lnMg=="},
                    {"type": "text", "text": "Let me check."},
                    {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}},
                ],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "22C"}]},
        ],
    }
    answer = httpx.post(qwen3_server.url + "/v1/messages", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]  # Anthropic's input_tokens leave out the cached prefix
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == len(want)
    counted = httpx.post(qwen3_server.url + "/v1/messages/count_tokens", json=body, timeout=60).json()
    assert counted == {"input_tokens": len(want)}
    keyer = TokenKeyer.from_dir(str(qwen3_model), 16)
    assert keyer.token_ids("/v1/chat/completions", messages_as_chat(body)) == want
    assert keyer.keys("/v1/messages", body)[1] == len(want)
