"""``--reasoning-parser qwen3`` with a chat template that opens the thinking in the prompt, as
Qwen3-Thinking-2507's and Qwen3.5's do (``<think>\\n`` after the assistant header, so the model writes
only ``…</think>answer``): the answer is read as vLLM's qwen3 parser reads it, thoughts first, the same
whole and streamed. With thinking switched off (``enable_thinking: false`` puts an empty
``<think></think>`` in the prompt) the answer stays content.

The model is a tiny random Llama whose tokenizer has ``<think>`` and ``</think>``; ``logit_bias`` on
``</think>`` decides whether (and when) the greedy model ends its thoughts."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from engine.demo import build_model
from engine.tokenizer import Tokenizer

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
)
BODY = {
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 12,
    "temperature": 0,
    "ignore_eos": True,
}


@pytest.fixture(scope="module")
def thinker(models_root: Path) -> Path:
    return build_model(models_root / "qwen3_thinker", "llama", seed=5, extra_tokens=("<think>", "</think>"))


@pytest.fixture(scope="module")
def end_id(thinker: Path) -> int:
    (end,) = Tokenizer.from_dir(thinker).encode("</think>", add_special_tokens=False)
    return end


@pytest.fixture(scope="module")
def srv(server_process, thinker: Path, serve_logs: Path, tmp_path_factory: pytest.TempPathFactory):
    template = tmp_path_factory.mktemp("qwen3_template") / "qwen3.jinja"
    template.write_text(TEMPLATE)
    proc = server_process(
        thinker, ["--reasoning-parser", "qwen3", "--chat-template", str(template)], serve_logs
    )
    proc.start()
    yield proc
    proc.stop()


def _whole(srv, body: dict) -> dict:
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    return {"reasoning": message.get("reasoning_content"), "content": message["content"]}


def _streamed(srv, body: dict) -> dict:
    reasoning = content = ""
    with httpx.stream(
        "POST", srv.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    reasoning += c["delta"].get("reasoning_content") or ""
                    content += c["delta"].get("content") or ""
    return {"reasoning": reasoning or None, "content": content or None}


def test_thinking_opened_by_the_prompt_is_reasoning(srv, thinker: Path, end_id: int) -> None:
    # Thoughts that never end (</think> forbidden): all reasoning, as a cut-off thinking model's.
    unfinished = {**BODY, "logit_bias": {str(end_id): -100.0}}
    whole = _whole(srv, unfinished)
    assert whole["reasoning"] and whole["content"] is None and "</think>" not in whole["reasoning"]
    assert _streamed(srv, unfinished) == whole
    # Thoughts that end: the tokens before </think> are the reasoning, the text after it the answer.
    ended = {**BODY, "logit_bias": {str(end_id): 1.5}, "return_token_ids": True}
    r = httpx.post(srv.url + "/v1/chat/completions", json=ended, timeout=60)
    ids = r.json()["choices"][0]["token_ids"]
    assert end_id in ids[1:]  # this greedy model thinks a few tokens, then ends its thoughts
    whole = _whole(srv, ended)
    tokenizer = Tokenizer.from_dir(thinker)
    assert whole["reasoning"] == tokenizer.decode(ids[: ids.index(end_id)])
    assert whole["content"] and whole["reasoning"] + "</think>" + whole["content"] == tokenizer.decode(ids)
    assert _streamed(srv, ended) == whole


def test_thinking_switched_off_is_content(srv, end_id: int) -> None:
    off = {**BODY, "logit_bias": {str(end_id): -100.0}, "chat_template_kwargs": {"enable_thinking": False}}
    whole = _whole(srv, off)
    assert whole["reasoning"] is None and whole["content"]
    assert _streamed(srv, off) == whole
    # The same greedy tokens as with thinking on (the prompts differ in the closed tag only after
    # the header, so compare shapes, not text): what was reasoning there is content here.
    on = _whole(srv, {**BODY, "logit_bias": {str(end_id): -100.0}})
    assert on["content"] is None and on["reasoning"]
