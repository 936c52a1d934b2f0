"""The router's own error answers are OpenAI's shape, ``{"error": {"message", "type", "param",
"code"}}``, with ``code`` a string as a replica writes it (``server/errors.py``: ``invalid_api_key``,
``rate_limit_exceeded``, ``service_unavailable``…), never the HTTP status: the openai SDK reads them
into its exceptions (its ``code`` would be ``"503"`` otherwise)."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest
from router_harness import Cluster, Proc, wait_until
from scripted_replica import GATE, ScriptedReplica, text_chunk

KEY = "k-123"
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ScriptedReplica, Proc]]:
    replica = ScriptedReplica()
    tmp = tmp_path_factory.mktemp("error-shape")
    cluster = Cluster(tmp, tmp)
    router = cluster.router(
        "--replica", replica.url, "--api-key", KEY, "--max-concurrency", "1", "--max-queue", "0",
        "--max-request-bytes", "2000", "--max-failovers", "0",
    )  # fmt: skip
    assert wait_until(lambda: _routable(router) == [True], 30)
    yield replica, router
    cluster.close()
    replica.close()


def _routable(router: Proc) -> list[bool]:
    view = httpx.get(router.url + "/admin/replicas", headers=AUTH, timeout=5).json()
    return [r["routable"] for r in view["replicas"]]


def _client(router: Proc, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key=key, max_retries=0, timeout=30)


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert list(body) == ["error"] and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_the_sdk_reads_the_routers_own_errors(setup: tuple[ScriptedReplica, Proc]) -> None:
    replica, router = setup
    with pytest.raises(openai.AuthenticationError) as auth:
        _client(router, "wrong").completions.create(model="m", prompt="hi", max_tokens=1)
    assert (auth.value.code, auth.value.type, auth.value.param) == (
        "invalid_api_key",
        "AuthenticationError",
        None,
    )

    with pytest.raises(openai.APIStatusError) as large:
        _client(router).completions.create(model="m", prompt="x" * 3000, max_tokens=1)
    assert (large.value.status_code, large.value.code) == (413, "request_too_large")

    replica.script = [GATE, text_chunk("a", 5, "stop"), b"data: [DONE]\n\n", "done"]
    held = _client(router).completions.create(model="m", prompt="hi", max_tokens=1, stream=True)
    try:  # the one slot is taken and no request may wait: the router's 429
        with pytest.raises(openai.RateLimitError) as limited:
            _client(router).completions.create(model="m", prompt="hi", max_tokens=1)
        assert (limited.value.code, limited.value.type) == ("rate_limit_exceeded", "RateLimitError")
    finally:
        replica.release()
        assert [c.choices[0].text for c in held] == ["a"]

    # A stream the replica broke off, which the router may not resume: its in-stream error event.
    replica.script = [text_chunk("a", 5)]
    with pytest.raises(openai.APIError) as broken:
        list(_client(router).completions.create(model="m", prompt="hi", max_tokens=4, stream=True))
    assert broken.value.code == "bad_gateway"

    replica.hung = True  # its /health answers 503: ejected, no replica left
    try:
        assert wait_until(lambda: _routable(router) == [False], 30)
        with pytest.raises(openai.InternalServerError) as down:
            _client(router).completions.create(model="m", prompt="hi", max_tokens=1)
        assert (down.value.status_code, down.value.code) == (503, "service_unavailable")
    finally:
        replica.hung = False
        assert wait_until(lambda: _routable(router) == [True], 30)


def test_edge_errors_name_a_code_as_a_replica_does(setup: tuple[ScriptedReplica, Proc]) -> None:
    _, router = setup

    def post(path: str, content: bytes) -> httpx.Response:
        return httpx.post(router.url + path, content=content, headers=AUTH, timeout=10)

    assert _error(post("/v1/chat/completions", b"{not json"), 400)["code"] == "invalid_json"
    assert _error(post("/v1/chat/completions", b"[1]"), 400)["code"] == "invalid_value"
    missing = _error(post("/v1/unload_lora_adapter", b"{}"), 400)
    assert (missing["param"], missing["code"]) == ("lora_name", "missing_required_parameter")
    assert _error(post("/v1/load_lora_adapter", b"{not json"), 400)["code"] == "invalid_json"
    assert _error(httpx.get(router.url + "/nowhere", timeout=10), 404)["code"] == "not_found"
    assert _error(httpx.delete(router.url + "/health", timeout=10), 405)["code"] == "method_not_allowed"
    assert _error(httpx.get(router.url + "/v1/models", timeout=10), 401) == {
        "message": "missing or wrong API key (Authorization: Bearer …)",
        "type": "AuthenticationError",
        "param": None,
        "code": "invalid_api_key",
    }


def _anthropic(router: Proc, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=router.url, api_key=key, max_retries=0, timeout=30)


def _named(error: anthropic.APIStatusError) -> str:
    """The error's request id, the same in its ``request-id`` header and its body (Anthropic's)."""
    assert error.request_id == error.body["request_id"] == error.response.headers["x-request-id"]
    return error.body["error"]["type"]


def test_the_routers_own_refusals_on_the_messages_api_are_anthropics(
    setup: tuple[ScriptedReplica, Proc],
) -> None:
    """On ``/v1/messages`` the router's own answers (no key, too large, not JSON, its concurrency
    limit, no replica) are Anthropic's, read by its SDK into its typed errors."""
    replica, router = setup
    turn = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.AuthenticationError) as auth:
        _anthropic(router, "wrong").messages.create(model="m", max_tokens=1, messages=turn)
    assert _named(auth.value) == "authentication_error"

    with pytest.raises(anthropic.ContentTooLargeError) as large:
        _anthropic(router).messages.create(
            model="m", max_tokens=1, messages=[{"role": "user", "content": "x" * 3000}]
        )
    assert _named(large.value) == "request_too_large"

    r = httpx.post(
        router.url + "/v1/messages", content=b"{not json", headers={"x-api-key": KEY, "x-request-id": "j-1"}
    )
    assert r.status_code == 400 and r.headers["request-id"] == "j-1"
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["request_id"] == "j-1"

    replica.hold()  # (released by the test before)
    replica.script = [GATE, text_chunk("a", 5, "stop"), b"data: [DONE]\n\n", "done"]
    held = _client(router).completions.create(model="m", prompt="hi", max_tokens=1, stream=True)
    try:  # its one slot taken, no queue: the router's 429, Anthropic's 529
        with pytest.raises(anthropic.OverloadedError) as limited:
            _anthropic(router).messages.create(model="m", max_tokens=1, messages=turn)
        assert _named(limited.value) == "overloaded_error" and limited.value.status_code == 529
        assert limited.value.response.headers["retry-after"]
    finally:
        replica.release()
        assert [c.choices[0].text for c in held] == ["a"]

    replica.hung = True  # no replica left: the router's 503, Anthropic's 529
    try:
        assert wait_until(lambda: _routable(router) == [False], 30)
        with pytest.raises(anthropic.OverloadedError) as down:
            _anthropic(router).messages.create(model="m", max_tokens=1, messages=turn)
        assert _named(down.value) == "overloaded_error"
    finally:
        replica.hung = False
        assert wait_until(lambda: _routable(router) == [True], 30)
