"""Anthropic's ``tool_result`` blocks on ``POST /v1/messages`` beyond plain text: ``is_error``
reaches the prompt (the tool message says ``Error: …``), an image inside a result is refused by a
text-only model with a 400 in Anthropic's shape (a vision model's case: test_llava_serve.py), a bad
block's 400 names it, and paths under ``/v1/messages`` that are not routes answer in Anthropic's
error shape."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import pytest

from server.anthropic_protocol import MessagesRequest
from server.serving_messages import to_chat_request
from tests.server.test_messages_api import TEMPLATE

GREEDY = {"temperature": 0.0}
CALL = {
    "role": "assistant",
    "content": [
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
    ],
}
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}


def _conversation(result: dict) -> list[dict]:
    return [
        {"role": "user", "content": "Weather in Oslo?"},
        CALL,
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", **result}]},
    ]


@pytest.fixture(scope="module")
def srv(tiny_llama: Path, serve_logs: Path, server_process, tmp_path_factory) -> Iterator:
    template = tmp_path_factory.mktemp("template") / "tools.jinja"
    template.write_text(TEMPLATE)
    server = server_process(tiny_llama, ["--chat-template", str(template)], serve_logs).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(srv) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0, timeout=60)


def _tool_message(result: dict) -> dict:
    req = MessagesRequest.model_validate({"model": "m", "max_tokens": 4, "messages": _conversation(result)})
    messages = to_chat_request(req).model_dump(exclude_none=True)["messages"]
    return next(m for m in messages if m["role"] == "tool")


def test_is_error_marks_the_tool_message() -> None:
    assert _tool_message({"content": "no such city"})["content"] == "no such city"
    assert _tool_message({"content": "no such city", "is_error": True})["content"] == "Error: no such city"
    parts = [{"type": "text", "text": "no such "}, {"type": "text", "text": "city"}]
    assert _tool_message({"content": parts, "is_error": True})["content"] == "Error: no such city"
    assert _tool_message({"is_error": True})["content"] == "Error"  # a failure with no detail


def test_is_error_reaches_the_prompt(srv, client) -> None:
    """The failed call's answer is the chat answer of the same conversation whose tool message says
    ``Error: …``, token for token, and its prompt is not the successful call's."""
    failed = _conversation({"content": "no such city", "is_error": True})
    m = client.messages.create(
        model=srv.model_name,
        max_tokens=8,
        messages=failed,  # type: ignore[arg-type]
        extra_body=GREEDY,
    )
    chat = {
        "model": srv.model_name,
        "max_tokens": 8,
        "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": "Checking.",
                "tool_calls": [
                    {
                        "id": "toolu_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: no such city"},
        ],
        **GREEDY,
    }
    r = httpx.post(srv.url + "/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 200, r.text
    assert m.content[0].text == r.json()["choices"][0]["message"]["content"]  # type: ignore[union-attr]
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == r.json()["usage"]["prompt_tokens"]
    counted = client.messages.count_tokens(model=srv.model_name, messages=failed)  # type: ignore[arg-type]
    succeeded = _conversation({"content": "no such city"})
    ok = client.messages.count_tokens(model=srv.model_name, messages=succeeded)  # type: ignore[arg-type]
    assert counted.input_tokens == r.json()["usage"]["prompt_tokens"] > ok.input_tokens


@pytest.mark.parametrize(
    ("path", "stream"),
    [("/v1/messages", False), ("/v1/messages", True), ("/v1/messages/count_tokens", False)],
)
def test_an_image_in_a_tool_result_to_a_text_only_model_is_a_400(srv, path: str, stream: bool) -> None:
    body = {
        "model": srv.model_name,
        "max_tokens": 4,
        "stream": stream,
        "messages": _conversation({"content": [{"type": "text", "text": "a chart:"}, IMAGE]}),
    }
    r = httpx.post(srv.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.headers["content-type"] == "application/json"
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert "this model takes text only" in error["error"]["message"]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (
            "messages",
            _conversation({"content": [{"type": "search_result", "source": "s"}]}),
            "'messages.2': tool_result content block type 'search_result' is not supported",
        ),
        (  # a document is read (its text), and named when it is not one
            "messages",
            _conversation({"content": [{"type": "document", "source": {}}]}),
            "'messages.2': tool_result content block 0 (document): 'source.type': Field required",
        ),
        (
            "messages",
            _conversation({"content": [{"type": "text", "text": "a"}, {"type": "image"}]}),
            "'messages.2': tool_result content block 1 (image): 'source': Field required",
        ),
        (
            "messages",
            [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text"}]}],
            "'messages.0': content block 1 (text): 'text': Field required",
        ),
        (
            "messages",
            [{"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]}],
            "'messages.0': content block 0 (image): 'source': a base64 image source needs media_type and data",
        ),
        (
            "messages",
            [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": [1]}]}],
            "'messages.0': content block 0 (tool_use): 'input': Input should be an object",
        ),
        (
            "messages",
            [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}],
            "'messages.0': content block 0 (tool_result): 'tool_use_id': Field required",
        ),
        ("system", [{"type": "image", "source": {}}], "'system': block type 'image' is not supported"),
        (
            "system",
            [{"type": "text", "text": 1}],
            "'system': block 0 (text): 'text': Input should be a valid string",
        ),
    ],
)
def test_a_bad_block_is_named_in_the_400(srv, field: str, value: object, message: str) -> None:
    """Not "Input should be a valid string (and 9 more error(s))": pydantic alone reports a bad block
    against every member of the content's union."""
    body = {
        "model": srv.model_name,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "x"}],
        field: value,
    }
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = httpx.post(srv.url + path, json=body, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"] == {
            "type": "invalid_request_error",
            "message": f"Invalid value for {message}",
        }


def test_unknown_paths_under_messages_answer_in_anthropics_shape(srv, client) -> None:
    for method, path, status in [
        ("POST", "/v1/messages/foo", 404),
        ("GET", "/v1/messages/batches/msgbatch_1", 404),
        ("GET", "/v1/messages", 405),
    ]:
        r = httpx.request(method, srv.url + path, json={}, timeout=30)
        assert r.status_code == status, (path, r.text)
        body = r.json()
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, (path, body)
        assert body["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    with pytest.raises(anthropic.NotFoundError) as e:  # the SDK reads it as Anthropic's error
        client.post("/v1/messages/foo", body={}, cast_to=httpx.Response)
    error = {"type": "not_found_error", "message": "Not Found"}
    assert e.value.body == {"type": "error", "error": error, "request_id": e.value.request_id}
    for path in ("/v1/messagesfoo", "/v1/nothing", "/v2/messages/foo"):  # other paths: OpenAI's shape
        r = httpx.post(srv.url + path, json={}, timeout=30)
        assert r.status_code == 404
        assert r.json() == {
            "error": {"message": "Not Found", "type": "NotFoundError", "param": None, "code": "not_found"}
        }
