"""A live replica renders real families' chat templates as transformers does (``/tokenize`` and a
chat's ``usage.prompt_tokens``), and the router's ``TokenKeyer`` gives the same token ids: an
assistant's earlier reasoning, empty tool-call arguments, DeepSeek's concatenated arguments, a
trimming template's ``continue_final_message``, vLLM's ``documents``. A template that raises is a
400 with its message, a stream's too."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from family_chat_templates import DEEPSEEK_R1, MIXTRAL, QWEN3
from family_template_cases import CASES, USER, hf_ids

from router.prompt_keys import TokenKeyer


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
