"""Anthropic's rules for the turns of a ``POST /v1/messages`` (and ``/count_tokens``) conversation,
which the chat translation cannot keep by itself: every message has content but an optional final
assistant one, and a ``tool_use`` block belongs to an assistant turn, a ``tool_result`` block to a
user turn. A request that breaks one is a 400 in Anthropic's shape naming the message, never a
chat request's error nor an answer that left the message out."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from tests.server.conftest import ServerProcess

CALL = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "4 C, rain"}
EMPTY = "all messages must have non-empty content except for the optional final assistant message"


def _post(server: ServerProcess, path: str, messages: list[dict], **extra: object) -> httpx.Response:
    body: dict = {"model": server.model_name, "messages": messages, **extra}
    if path == "/v1/messages":
        body["max_tokens"] = 2
    return httpx.post(server.url + path, json=body, timeout=60)


def _refused(r: httpx.Response, message: str) -> None:
    assert r.status_code == 400, r.text
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": message}}


@pytest.mark.parametrize(
    ("messages", "index", "problem"),
    [
        ([{"role": "user", "content": []}], 0, "the only message must have non-empty content"),
        ([{"role": "user", "content": ""}], 0, "the only message must have non-empty content"),
        ([{"role": "assistant", "content": []}], 0, "the only message must have non-empty content"),
        (
            [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": []},
                {"role": "user", "content": "b"},
            ],
            1,
            EMPTY,
        ),
        ([{"role": "user", "content": []}, {"role": "assistant", "content": "x"}], 0, EMPTY),
    ],
)
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_an_empty_message_is_named(
    server: ServerProcess, path: str, messages, index: int, problem: str
) -> None:
    _refused(_post(server, path, messages), f"Invalid value for 'messages.{index}': {problem}")


@pytest.mark.parametrize("content", ["", []])
def test_an_empty_final_assistant_message_is_taken(server: ServerProcess, content: object) -> None:
    messages = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": content}]
    claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=60)
    m = claude.messages.create(model=server.model_name, max_tokens=2, messages=messages)  # type: ignore[arg-type]
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 2
    assert _post(server, "/v1/messages/count_tokens", messages).status_code == 200


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        (
            [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": [CALL, RESULT]}],
            "Invalid value for 'messages.1': content block 1 (tool_result): "
            "a tool_result block may appear only in the user's messages",
        ),
        (
            [{"role": "user", "content": [{"type": "text", "text": "Weather?"}, CALL]}],
            "Invalid value for 'messages.0': content block 1 (tool_use): "
            "a tool_use block may appear only in the assistant's messages",
        ),
    ],
)
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_a_tool_block_on_the_wrong_side_is_named(
    server: ServerProcess, path: str, messages, message: str
) -> None:
    _refused(_post(server, path, messages), message)
    if path == "/v1/messages":  # refused before any stream starts
        _refused(_post(server, path, messages, stream=True), message)
    claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=60)
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model=server.model_name, max_tokens=2, messages=messages)
    assert err.value.body == {"type": "error", "error": {"type": "invalid_request_error", "message": message}}
