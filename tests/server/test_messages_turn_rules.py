"""Anthropic's rules for the turns of a ``POST /v1/messages`` (and ``/count_tokens``) conversation,
which the chat translation cannot keep by itself: every message has content but an optional final
assistant one; a ``tool_use`` block belongs to an assistant turn, a ``tool_result`` or an ``image``
block to a user turn; no text block is empty; each ``tool_result`` answers a ``tool_use`` of the
assistant turn just before it, and every call is answered in the next turn. A request that breaks
one is a 400 in Anthropic's shape naming the message, never a chat request's error nor an answer
that left something out."""

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
    error = {"type": "invalid_request_error", "message": message}
    assert r.json() == {"type": "error", "error": error, "request_id": r.headers["request-id"]}


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
    error = {"type": "invalid_request_error", "message": message}
    assert err.value.body == {"type": "error", "error": error, "request_id": err.value.request_id}


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
UNEXPECTED = (
    "content block 0 (tool_result): unexpected `tool_use_id` found in `tool_result` blocks: {}. "
    "Each `tool_result` block must have a corresponding `tool_use` block in the previous message."
)
UNANSWERED = (
    "`tool_use` ids were found without `tool_result` blocks immediately after: {}. "
    "Each `tool_use` block must have a corresponding `tool_result` block in the next message."
)


def _refused_everywhere(server: ServerProcess, messages: list[dict], message: str, **extra: object) -> None:
    """The same 400 from both paths, streamed or not, and through Anthropic's own SDK."""
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        _refused(_post(server, path, messages, **extra), message)
    _refused(_post(server, "/v1/messages", messages, stream=True, **extra), message)
    claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=60)
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model=server.model_name, max_tokens=2, messages=messages, **extra)  # type: ignore[arg-type]
    error = {"type": "invalid_request_error", "message": message}
    assert err.value.body == {"type": "error", "error": error, "request_id": err.value.request_id}


def test_an_image_in_an_assistant_turn_is_refused(server: ServerProcess) -> None:
    """Anthropic answers 400 ("'image' blocks are not permitted within assistant turns"); it was
    dropped from the prompt unsaid."""
    messages = [
        {"role": "user", "content": "Draw a cat."},
        {"role": "assistant", "content": [{"type": "text", "text": "Here:"}, IMAGE]},
        {"role": "user", "content": "Thanks."},
    ]
    _refused_everywhere(
        server,
        messages,
        "Invalid value for 'messages.1': content block 1 (image): "
        "an image block may appear only in the user's messages",
    )


@pytest.mark.parametrize(
    ("messages", "extra", "message"),
    [
        (
            [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": ""}]}],
            {},
            "Invalid value for 'messages.0': content block 1 (text): 'text': text content blocks must be non-empty",
        ),
        (  # an assistant turn's, as clients echo a tool-calling answer back
            [
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": [{"type": "text", "text": ""}, CALL]},
                {"role": "user", "content": [RESULT]},
            ],
            {},
            "Invalid value for 'messages.1': content block 0 (text): 'text': text content blocks must be non-empty",
        ),
        (
            [
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": [CALL]},
                {"role": "user", "content": [{**RESULT, "content": [{"type": "text", "text": ""}]}]},
            ],
            {},
            "Invalid value for 'messages.2': tool_result content block 0 (text): 'text': "
            "text content blocks must be non-empty",
        ),
        (
            [{"role": "user", "content": "a"}],
            {"system": [{"type": "text", "text": ""}]},
            "Invalid value for 'system': block 0 (text): 'text': text content blocks must be non-empty",
        ),
    ],
)
def test_an_empty_text_block_is_refused(server: ServerProcess, messages, extra, message: str) -> None:
    _refused_everywhere(server, messages, message, **extra)


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        (  # no such call in the turn before
            [
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": [CALL]},
                {"role": "user", "content": [{**RESULT, "tool_use_id": "toolu_9"}]},
            ],
            "Invalid value for 'messages.2': " + UNEXPECTED.format("toolu_9"),
        ),
        (  # no turn before at all
            [{"role": "user", "content": [RESULT]}],
            "Invalid value for 'messages.0': " + UNEXPECTED.format("toolu_1"),
        ),
        (  # a call of an earlier turn, answered already
            [
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": [CALL]},
                {"role": "user", "content": [RESULT]},
                {"role": "assistant", "content": "Rain."},
                {"role": "user", "content": [RESULT]},
            ],
            "Invalid value for 'messages.4': " + UNEXPECTED.format("toolu_1"),
        ),
        (  # a call the next turn leaves unanswered (named where the call is)
            [
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": [CALL, {**CALL, "id": "toolu_2"}]},
                {"role": "user", "content": [RESULT]},
            ],
            "Invalid value for 'messages.1': " + UNANSWERED.format("toolu_2"),
        ),
    ],
)
def test_tool_results_answer_the_calls_of_the_turn_before(
    server: ServerProcess, messages, message: str
) -> None:
    _refused_everywhere(server, messages, message)


def test_consecutive_messages_of_a_role_are_one_turn(server: ServerProcess) -> None:
    """As Anthropic combines them: a call in the first of two assistant messages is answered in the
    second of two user messages, and a conversation may end at its calls."""
    answered = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [CALL]},
        {"role": "assistant", "content": "Checking."},
        {"role": "user", "content": "Please."},
        {"role": "user", "content": [RESULT]},
    ]
    for messages in (answered, answered[:2]):
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            r = _post(server, path, messages)
            assert r.status_code == 200, r.text
        assert r.json()["input_tokens"] > 0
