"""``/tokenize`` takes ``continue_final_message`` as chat completions do (vLLM's): the prompt ends
inside the last message, so a client that counts tokens there gets the chat request's count; with
``add_generation_prompt`` also true it is the same 400 as chat's."""

from __future__ import annotations

import httpx

MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello th"}]


def test_tokenize_continues_the_final_message_as_chat_does(server) -> None:
    body = {"model": server.model_name, "messages": MESSAGES, "add_generation_prompt": False}
    continued = {**body, "continue_final_message": True}
    r = httpx.post(server.url + "/tokenize", json=continued, timeout=30)
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    text = httpx.post(server.url + "/detokenize", json={"tokens": tokens}, timeout=30).json()["prompt"]
    assert text.endswith("assistant\nHello th")
    closed = httpx.post(server.url + "/tokenize", json=body, timeout=30).json()["tokens"]
    assert len(closed) > len(tokens) and closed[: len(tokens) - 1] == tokens[:-1]
    chat = {**continued, "max_tokens": 1}
    usage = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60).json()["usage"]
    assert usage["prompt_tokens"] == len(tokens)


def test_tokenize_refuses_continuing_a_new_turn_like_chat(server) -> None:
    body = {"model": server.model_name, "messages": MESSAGES, "continue_final_message": True}
    tokenize = httpx.post(server.url + "/tokenize", json=body, timeout=30)
    chat = httpx.post(server.url + "/v1/chat/completions", json={**body, "max_tokens": 1}, timeout=30)
    assert tokenize.status_code == chat.status_code == 400
    assert tokenize.json() == chat.json()
    assert tokenize.json()["error"]["message"] == (
        "Invalid request body: continue_final_message and add_generation_prompt cannot both be true"
    )
