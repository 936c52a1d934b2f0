"""Errors of ``/v1/responses`` and ``/v1/messages`` name the fields the client sent, not the chat
fields those requests become inside the server: ``max_output_tokens`` (not ``max_tokens``),
``input`` (not ``messages``), ``text.format`` (not ``response_format``), ``stop_sequences`` (not
``stop``), in ``param`` and in the message."""

from __future__ import annotations

import httpx
import pytest


def _post(server, path: str, body: dict) -> dict:
    r = httpx.post(server.url + path, json={"model": server.model_name, **body}, timeout=60)
    assert r.status_code == 400, r.text
    return r.json()


def _capacity(server) -> int:
    return httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["max_model_len"]


@pytest.mark.parametrize("stream", [False, True])
def test_responses_budget_errors_name_max_output_tokens(server, stream) -> None:
    capacity = _capacity(server)
    body = {"input": "hi", "max_output_tokens": 100000, "stream": stream}
    error = _post(server, "/v1/responses", body)["error"]
    assert (error["param"], error["code"]) == ("max_output_tokens", "context_length_exceeded")
    assert error["message"].startswith(f"This model's maximum context length is {capacity} tokens. However")
    assert error["message"].endswith("Reduce the prompt or max_output_tokens.")
    error = _post(server, "/v1/responses", {"input": "hi", "max_output_tokens": 3, "min_tokens": 4})["error"]
    assert (error["param"], error["message"]) == (
        "min_tokens",
        "min_tokens (4) must not exceed max_output_tokens (3)",
    )


def test_responses_prompt_errors_name_input(server) -> None:
    error = _post(server, "/v1/responses", {"input": "hi " * 4000, "max_output_tokens": 5})["error"]
    assert (error["param"], error["code"]) == ("input", "context_length_exceeded")


def test_responses_format_errors_name_text_format(server) -> None:
    fmt = {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}
    error = _post(server, "/v1/responses", {"input": "hi", "text": {"format": fmt}})["error"]
    assert error["param"] == "text.format"
    assert error["message"].startswith("invalid structured outputs json: ")
    fmt = {"type": "json_schema", "name": "x"}
    error = _post(server, "/v1/responses", {"input": "hi", "text": {"format": fmt}})["error"]
    assert (error["param"], error["message"]) == (
        "text.format",
        "text.format of type 'json_schema' needs schema",
    )
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    body = {
        "input": "hi",
        "text": {"format": {"type": "json_object"}},
        "tools": [tool],
        "tool_choice": "required",
    }
    error = _post(server, "/v1/responses", body)["error"]
    assert error["param"] == "tool_choice"
    assert error["message"] == (
        "tool_choice 'required' constrains the output itself: it cannot be combined with text.format"
    )


def test_messages_errors_name_stop_sequences(server) -> None:
    body = {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "stop_sequences": [""]}
    error = _post(server, "/v1/messages", body)
    assert error.pop("request_id") and error == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "Invalid value for 'stop_sequences': stop sequences must be non-empty strings",
        },
    }
