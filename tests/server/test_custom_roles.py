"""Chat messages with roles of the template's own (vLLM's custom message param): any non-empty
string role reaches the chat template as written (Llama 3.1's template writes ``ipython`` turns);
a template that refuses a role (``raise_exception``) is a 400 in its own words. The Anthropic and
Responses APIs keep their own roles. The router keys such a chat as the replica renders it.

One replica over tiny_llama (its ChatML template writes each message's role) that trusts request
templates, so a request can bring a template that raises on roles it does not know.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from kvcache.keys import block_hashes
from router.pd_messages import request_error
from router.prompt_keys import TokenKeyer

MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "weather?"},
    {"role": "ipython", "content": '{"temp": 4}'},
]
RENDERED = (
    "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nweather?<|im_end|>\n"
    '<|im_start|>ipython\n{"temp": 4}<|im_end|>\n<|im_start|>assistant\n'
)
# A template that knows three roles, as many checkpoints' templates do.
STRICT = (
    "{% for m in messages %}{% if m.role not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + m.role) }}{% endif %}[{{ m.role }}] {{ m.content }}\n"
    "{% endfor %}"
)
GREEDY = {"temperature": 0, "max_tokens": 4}


@pytest.fixture(scope="module")
def srv(tiny_llama: Path, serve_logs: Path, server_process) -> Iterator:
    flags = ["--trust-request-chat-template", "--num-kv-blocks", "64"]
    proc = server_process(tiny_llama, flags, serve_logs).start()
    yield proc
    proc.stop()


def _post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=60)


def test_custom_role_reaches_the_template_as_written(srv, tokenizer) -> None:
    want = tokenizer.encode(RENDERED, add_special_tokens=False)
    r = _post(srv, "/tokenize", {"messages": MESSAGES})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == want
    assert _post(srv, "/detokenize", {"tokens": want}).json()["prompt"] == RENDERED
    # The OpenAI SDK sends the message dict as it is; the prompt counted is the one rendered.
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
    answer = client.chat.completions.create(model=srv.model_name, messages=MESSAGES, **GREEDY)
    assert answer.usage.prompt_tokens == len(want)
    assert answer.choices[0].message.role == "assistant"


def test_a_continued_custom_role_message_answers_with_its_role(srv) -> None:
    messages = [MESSAGES[1], {"role": "ipython", "content": '{"temp":'}]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True, **GREEDY}
    plain = _post(srv, "/v1/chat/completions", body).json()["choices"][0]["message"]
    assert plain["role"] == "ipython"
    echoed = _post(srv, "/v1/chat/completions", {**body, "echo": True}).json()["choices"][0]["message"]
    assert echoed == {"role": "ipython", "content": '{"temp":' + plain["content"]}
    with httpx.stream(
        "POST", srv.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
    assert '"delta":{"role":"ipython","content":""}' in first


def test_a_template_that_refuses_the_role_is_a_400_in_its_words(srv) -> None:
    error = {
        "message": "chat template error: Unknown role: ipython",
        "type": "BadRequestError",  # vLLM's name for a 400's type, as every ferry 400
        "param": "messages",
        "code": "invalid_value",
    }
    for path, extra in (("/v1/chat/completions", GREEDY), ("/tokenize", {})):
        r = _post(srv, path, {"messages": MESSAGES, "chat_template": STRICT, **extra})
        assert r.status_code == 400, r.text
        assert r.json()["error"] == error
    known = _post(srv, "/tokenize", {"messages": MESSAGES[:2], "chat_template": STRICT})
    assert known.status_code == 200, known.text  # the same template takes the roles it knows


@pytest.mark.parametrize("role", ["", 5, None])
def test_an_empty_or_non_string_role_is_refused(srv, role) -> None:
    message = {"role": role, "content": "x"} if role is not None else {"content": "x"}
    for path, extra in (("/v1/chat/completions", GREEDY), ("/tokenize", {})):
        r = _post(srv, path, {"messages": [message], **extra})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "messages.0.role"


def test_anthropic_and_responses_keep_their_roles(srv) -> None:
    messages = _post(
        srv, "/v1/messages", {"model": srv.model_name, "max_tokens": 4, "messages": [MESSAGES[2]]}
    )
    assert messages.status_code == 400, messages.text
    assert messages.json()["error"]["type"] == "invalid_request_error"
    assert "messages.0.role" in messages.json()["error"]["message"]
    item = {"type": "message", "role": "ipython", "content": "x"}
    responses = _post(
        srv, "/v1/responses", {"model": srv.model_name, "input": [item], "max_output_tokens": 4}
    )
    assert responses.status_code == 400, responses.text
    assert (
        responses.json()["error"]["message"] == "input[0].role must be user, system, developer or assistant"
    )


def test_router_keys_a_custom_role_chat_as_the_replica_renders_it(srv, tiny_llama: Path) -> None:
    ids = _post(srv, "/tokenize", {"messages": MESSAGES}).json()["tokens"]
    hashes, count = TokenKeyer.from_dir(str(tiny_llama), 4).keys(
        "/v1/chat/completions", {"messages": MESSAGES}
    )
    assert count == len(ids) and hashes == block_hashes(ids, 4)
    # The PD router checks a body as a replica does: a custom role passes, an empty one does not.
    assert (
        request_error("/v1/chat/completions", b'{"messages": [{"role": "ipython", "content": "x"}]}') is None
    )
    refused = request_error("/v1/chat/completions", b'{"messages": [{"role": "", "content": "x"}]}')
    assert refused is not None and refused.param == "messages.0.role"
