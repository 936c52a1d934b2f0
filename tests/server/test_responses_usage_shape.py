"""A Responses answer validates against the OpenAI SDK's own types, field for field: its ``usage``
carries ``input_tokens_details.cache_write_tokens`` (a required integer there, as ``cached_tokens``
is), whether the response is returned, streamed (``response.completed`` / ``.incomplete``) or
retrieved. Typed clients that check required fields read it; the Python SDK alone would not notice."""

from __future__ import annotations

import json

import httpx
import pydantic
from openai.types.responses import Response, ResponseStreamEvent

EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)


def _usage_ok(usage: dict, input_tokens: int | None = None) -> None:
    details = usage["input_tokens_details"]
    # ferry writes prompt blocks to its prefix cache without billing them: none are reported written,
    # as the Messages API reports cache_creation_input_tokens 0.
    assert details["cache_write_tokens"] == 0
    assert 0 <= details["cached_tokens"] <= usage["input_tokens"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def test_returned_and_retrieved_responses_validate(server) -> None:
    body = {"model": server.model_name, "input": "Name a colour.", "max_output_tokens": 3}
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text
    answer = r.json()
    Response.model_validate(answer)
    _usage_ok(answer["usage"])
    assert answer["usage"]["output_tokens"] == 3
    got = httpx.get(server.url + f"/v1/responses/{answer['id']}", timeout=30)
    assert got.status_code == 200
    Response.model_validate(got.json())
    assert got.json()["usage"] == answer["usage"]


def test_streamed_events_validate(server) -> None:
    body = {"model": server.model_name, "input": "Name a colour.", "max_output_tokens": 3, "stream": True}
    types = []
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:"):
                event = json.loads(line[5:])
                EVENTS.validate_python(event)
                types.append(event["type"])
                if event["type"] in ("response.completed", "response.incomplete"):
                    _usage_ok(event["response"]["usage"])
    assert types[0] == "response.created" and types[-1] == "response.incomplete"
