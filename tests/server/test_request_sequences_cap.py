"""A completions request may ask for at most ``--max-request-sequences`` sequences (prompts x n):
a body within the size limit holds millions of one-token prompts, each costing the server
kilobytes, so more is a 400 before any prompt is tokenized."""

from __future__ import annotations

import httpx
import pytest

from server.completion_protocol import CompletionRequest
from server.prompts import check_request_sequences

LIMIT = 16384  # ferry serve's default


def test_a_request_of_more_sequences_than_the_limit_is_refused(server) -> None:  # noqa: ANN001
    body = {"model": server.model_name, "prompt": [[1]] * (LIMIT + 1), "max_tokens": 1}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt" and error["type"] == "BadRequestError"
    assert error["message"] == (
        f"this request asks for {LIMIT + 1} sequences ({LIMIT + 1} prompts x n=1), more than this "
        f"server takes in one request ({LIMIT}, --max-request-sequences): split it"
    )
    body = {"model": server.model_name, "prompt": [[1]] * 129, "n": 128, "max_tokens": 1}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and "129 prompts x n=128" in r.json()["error"]["message"], r.text
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200


@pytest.mark.parametrize(
    ("fields", "embeds", "sequences"),
    [
        ({"prompt": "one text"}, 0, 1),
        ({"prompt": [1, 2, 3]}, 0, 1),
        ({"prompt": ["a", "b", "c"]}, 0, 3),
        ({"prompt": [[1], [2]], "n": 3}, 0, 6),
        ({"prompt": ["a", "b"], "n": 2, "best_of": 3}, 0, 6),
        ({"prompt": "", "prompt_embeds": "x"}, 2, 2),
        ({"prompt": "a", "prompt_embeds": "x"}, 2, 3),
    ],
)
def test_sequences_are_prompts_times_the_width(fields: dict, embeds: int, sequences: int) -> None:
    req = CompletionRequest.model_construct(
        **{"model": "m", "n": 1, "best_of": None, "prompt_embeds": None, **fields}
    )
    check_request_sequences(req, embeds, sequences)  # exactly at the limit: taken
    with pytest.raises(Exception, match=f"asks for {sequences} sequences"):
        check_request_sequences(req, embeds, sequences - 1)
