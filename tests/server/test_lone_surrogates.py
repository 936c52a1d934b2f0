"""A lone UTF-16 surrogate escape in a JSON body (``"\\ud800"``) is a 400 on every route.

Python's ``json`` (FastAPI's body parser) accepts one and makes a str that no tokenizer can encode,
so the routes FastAPI parses answered 500 while the generation routes (pydantic's parser) said 400.
"""

from __future__ import annotations

import httpx
import pytest

MODEL = "llama"
ESCAPE = b"\\ud800"  # the six characters \ud800 as they travel in a JSON string

# (path, body with a lone surrogate where text goes)
CASES = [
    ("/tokenize", b'{"prompt": "a' + ESCAPE + b'b"}'),
    ("/tokenize", b'{"messages": [{"role": "user", "content": "' + ESCAPE + b'"}]}'),
    ("/v1/embeddings", b'{"input": "' + ESCAPE + b'"}'),
    ("/v1/embeddings", b'{"input": ["ok", "' + ESCAPE + b'"]}'),
    ("/v1/messages", b'{"max_tokens": 3, "messages": [{"role": "user", "content": "' + ESCAPE + b'"}]}'),
    ("/v1/messages/count_tokens", b'{"messages": [{"role": "user", "content": "' + ESCAPE + b'"}]}'),
    ("/invocations", b'{"prompt": "' + ESCAPE + b'", "max_tokens": 3}'),
    ("/invocations", b'{"input": "' + ESCAPE + b'"}'),
    # the generation routes refused it already: they stay as they were
    ("/v1/completions", b'{"prompt": "' + ESCAPE + b'", "max_tokens": 3}'),
    (
        "/v1/chat/completions",
        b'{"max_tokens": 3, "messages": [{"role": "user", "content": "' + ESCAPE + b'"}]}',
    ),
]


def _with_model(body: bytes) -> bytes:
    return b'{"model": "' + MODEL.encode() + b'", ' + body[1:]


@pytest.mark.parametrize(("path", "body"), CASES, ids=[f"{p}-{i}" for i, (p, _) in enumerate(CASES)])
def test_lone_surrogate_is_a_400(server, path: str, body: bytes) -> None:
    assert server.model_name == MODEL
    r = httpx.post(server.url + path, content=_with_model(body), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    message = error["message"]
    assert "not valid JSON" in message and "line 1 column" in message, error
    if path.startswith("/v1/messages"):  # Anthropic's error shape
        assert error["type"] == "invalid_request_error"
    else:
        assert error["code"] == "invalid_json"
    assert httpx.get(server.url + "/health").status_code == 200


def test_surrogate_pairs_and_non_ascii_still_parse(server) -> None:
    # An escaped pair (U+1F600) is one character, like the raw UTF-8 one, on a FastAPI-parsed route.
    escaped = httpx.post(
        server.url + "/tokenize",
        content=b'{"model": "llama", "prompt": "a\\ud83d\\ude00 \\u00e9"}',
        headers={"content-type": "application/json"},
    )
    raw = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": "a\U0001f600 \u00e9"})
    assert escaped.status_code == raw.status_code == 200, escaped.text
    assert escaped.json()["tokens"] == raw.json()["tokens"]
    assert escaped.json()["count"] > 0
