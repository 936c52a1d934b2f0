"""Client-caused errors: always a 4xx with OpenAI's error body, never a 5xx, never a dead server.

A table pins the status, ``param`` and ``code`` of each known mistake; a hypothesis fuzz throws
bounded batches of malformed JSON at the generation endpoints, the Responses API and embeddings,
and checks the server keeps serving.
"""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.error_cases import (
    CASES,
    CHAT,
    COMP,
    EMB,
    RESP,
    USER,
    bodies,
    embedding_bodies,
    responses_bodies,
)


def assert_error_body(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str)
    assert err["param"] is None or isinstance(err["param"], str)
    return err


@pytest.mark.parametrize(("path", "body", "status", "param", "code"), CASES)
def test_known_mistakes(server, path, body, status, param, code) -> None:
    r = httpx.post(server.url + path, content=json.dumps(body), headers={"content-type": "application/json"})
    err = assert_error_body(r, status)
    assert err["param"] == param and err["code"] == code


def test_context_length_message_names_the_numbers(server) -> None:
    r = httpx.post(server.url + COMP, json={"prompt": [5] * 1000, "max_tokens": 100})
    msg = assert_error_body(r, 400)["message"]
    assert "1024" in msg and "1100" in msg and "1000" in msg and "100" in msg


def test_tools_with_tool_choice_none_are_ignored(server) -> None:
    body = {
        "messages": USER,
        "max_tokens": 2,
        "tool_choice": "none",
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "response_format": {"type": "text"},
    }
    assert httpx.post(server.url + CHAT, json=body).status_code == 200


@pytest.mark.parametrize(
    "raw",
    [
        b"{",
        b"[]",
        b"null",
        b'"text"',
        b"\xff\xfe",
        b"{" * 5000 + b"}" * 5000,
        b'{"prompt": "x", "max_tokens": 1e400}',
    ],
)
def test_invalid_json(server, raw: bytes) -> None:
    r = httpx.post(server.url + COMP, content=raw, headers={"content-type": "application/json"})
    assert_error_body(r, 400)


def test_routing_errors_keep_the_shape(server) -> None:
    assert assert_error_body(httpx.get(server.url + "/v1/nothing"), 404)["code"] == "not_found"
    assert_error_body(httpx.delete(server.url + COMP), 405)


def test_body_over_limit_is_413_by_header_and_by_counting(server) -> None:
    limit = 8 * 1024 * 1024
    big = b'{"prompt": "' + b"a" * limit + b'"}'
    assert assert_error_body(httpx.post(server.url + COMP, content=big), 413)["code"] == "request_too_large"

    def chunks():  # chunked transfer: no Content-Length to trust
        for i in range(0, len(big), 1 << 20):
            yield big[i : i + (1 << 20)]

    assert_error_body(httpx.post(server.url + COMP, content=chunks()), 413)


def test_truncated_json_on_a_raw_socket(server) -> None:
    # A body cut off mid-object (as a crashed client would leave it) is a clean 400.
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 10\r\n\r\n{"prompt":'
        )
        data = s.recv(65536)
    assert data.startswith(b"HTTP/1.1 400")


def _bounded(body: object) -> object:
    """Keep valid bodies cheap: the fuzz is about validation, not about generating long texts."""
    if isinstance(body, dict):
        body = dict(body)
        for key, cap in (
            ("max_tokens", 4),
            ("max_completion_tokens", 4),
            ("n", 2),
            ("min_tokens", 2),
            ("best_of", 2),
        ):
            if isinstance(body.get(key), int) and not isinstance(body.get(key), bool) and body[key] > cap:
                body[key] = cap
        if not isinstance(body.get("max_tokens"), int) and not isinstance(
            body.get("max_completion_tokens"), int
        ):
            body.setdefault("max_completion_tokens", 4)
    return body


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(body=bodies, path=st.sampled_from([COMP, CHAT]), stream=st.booleans())
def test_fuzz_never_5xx(http, path: str, body: object, stream: bool) -> None:
    body = _bounded(body)
    if stream and isinstance(body, dict):
        body["stream"] = True
    r = http.post(
        path, content=json.dumps(body, allow_nan=False), headers={"content-type": "application/json"}
    )
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert_error_body(r, r.status_code)
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.endswith("data: [DONE]\n\n")
        assert '"error"' not in r.text or "InternalServerError" not in r.text


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(body=responses_bodies)
def test_responses_fuzz_never_5xx(http, body: object) -> None:
    if isinstance(body, dict):  # keep valid bodies cheap: at most 4 output tokens
        limit = body.get("max_output_tokens")
        body = {**body, "max_output_tokens": min(limit, 4) if isinstance(limit, int) else 4}
    r = http.post(
        RESP, content=json.dumps(body, allow_nan=False), headers={"content-type": "application/json"}
    )
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert_error_body(r, r.status_code)
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert '"type": "response.' in r.text and "InternalServerError" not in r.text
    else:
        assert r.json()["object"] == "response"


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(body=embedding_bodies)
def test_embeddings_fuzz_never_5xx(http, body: object) -> None:
    r = http.post(
        EMB, content=json.dumps(body, allow_nan=False), headers={"content-type": "application/json"}
    )
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert_error_body(r, r.status_code)
    else:
        data = r.json()["data"]
        assert data and all(d["object"] == "embedding" for d in data)


def test_server_still_serves_after_the_fuzz(server) -> None:
    r = httpx.post(server.url + COMP, json={"prompt": "x", "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(server.url + "/health").status_code == 200
