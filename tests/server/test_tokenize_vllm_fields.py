"""``/tokenize`` and ``/detokenize`` as vLLM answers them: ``/detokenize`` keeps special tokens
(vLLM returns the tokenizer's ``decode`` with its default, so a rendered chat prompt reads back
whole and re-tokenizes to the same ids); ``/tokenize`` checks ``tools`` as a chat request does;
the answer carries vLLM's fields (``token_strs`` null unless asked for). On the shared replica
over tiny_llama (ChatML; ``<|im_end|>`` is its EOS)."""

from __future__ import annotations

import httpx

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
RENDERED = (
    "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nName a color.<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def test_detokenize_keeps_special_tokens(server, tokenizer) -> None:
    start, end = (tokenizer.backend.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>"))
    assert end in tokenizer.eos_token_ids
    ids = [start, *tokenizer.encode("hi", add_special_tokens=False), end]
    r = _post(server, "/detokenize", {"tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": "<|im_start|>hi<|im_end|>"}
    assert _post(server, "/detokenize", {"tokens": [end]}).json() == {"prompt": "<|im_end|>"}


def test_a_rendered_chat_prompt_reads_back_whole(server) -> None:
    tokens = _post(server, "/tokenize", {"messages": MESSAGES}).json()["tokens"]
    text = _post(server, "/detokenize", {"tokens": tokens}).json()["prompt"]
    assert text == RENDERED
    again = _post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert again == tokens


def test_tokenize_answers_vllms_fields(server, tokenizer) -> None:
    tokens = tokenizer.encode(RENDERED, add_special_tokens=False)
    plain = _post(server, "/tokenize", {"messages": MESSAGES}).json()
    assert plain == {"count": len(tokens), "max_model_len": 1024, "tokens": tokens, "token_strs": None}
    asked = _post(server, "/tokenize", {"messages": MESSAGES, "return_token_strs": True}).json()
    assert asked["token_strs"] == tokenizer.convert_ids_to_tokens(tokens)
    assert asked["token_strs"][0] == "<|im_start|>"


def test_tokenize_checks_tools_as_chat_does(server) -> None:
    for tools, param in (
        ([{"type": "function", "function": {"name": ""}}], "tools.0.function.name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
            "tools.0.function.parameters",
        ),
        ([{"type": "retrieval"}], "tools.0.type"),
    ):
        tokenize = _post(server, "/tokenize", {"messages": MESSAGES, "tools": tools})
        chat = _post(server, "/v1/chat/completions", {"messages": MESSAGES, "tools": tools, "max_tokens": 1})
        assert tokenize.status_code == chat.status_code == 400, tokenize.text
        assert tokenize.json() == chat.json()
        assert tokenize.json()["error"]["param"] == param
    good = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert _post(server, "/tokenize", {"messages": MESSAGES, "tools": good}).status_code == 200
