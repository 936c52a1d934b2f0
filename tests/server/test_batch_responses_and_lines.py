"""Batch input files split at ``\\n`` only: a prompt holding U+2028, U+2029 or U+0085 (JSON allows
them raw in a string; ``json.dumps(..., ensure_ascii=False)`` writes them so) stays one line, on
upload, in a batch's run and in ``ferry run-batch``'s reader."""

from __future__ import annotations

import io
import json

import openai
import pytest

from server.batch_lines import file_lines
from tests.server.test_batch_api import _chat, _wait, client, replica  # noqa: F401 (fixtures)

CONTENT = "one\u2028two\u2029three\u0085four"


def _lines(text: str) -> list[str]:
    return list(file_lines(io.BytesIO(text.encode())))


def test_file_lines_split_at_newline_only() -> None:
    line = json.dumps(_chat("x", CONTENT), ensure_ascii=False)
    text = f"{line}\r\n\n  \n{line}\n"
    assert _lines(text) == [line + "\r", line]
    assert [json.loads(x)["body"]["messages"][0]["content"] for x in _lines(text)] == [CONTENT] * 2
    assert _lines("\ufeff" + text) == _lines(text)  # a file saved as "UTF-8 with BOM"


def test_batch_line_with_unicode_line_separators(client: openai.OpenAI, replica) -> None:  # noqa: F811
    data = (json.dumps(_chat("sep", CONTENT), ensure_ascii=False) + "\n").encode()
    upload = client.files.create(file=("requests.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = _wait(client, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 1, done
    (out,) = [json.loads(x) for x in client.files.content(done.output_file_id).text.split("\n") if x]
    direct = client.chat.completions.create(
        model=replica.model_name, messages=[{"role": "user", "content": CONTENT}], max_tokens=6, temperature=0
    )
    body = out["response"]["body"]
    assert out["custom_id"] == "sep" and body["usage"]["prompt_tokens"] == direct.usage.prompt_tokens
    assert body["choices"][0]["message"]["content"] == direct.choices[0].message.content


def _response_line(custom_id: str, **body: object) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/responses", "body": body}


def test_batch_of_responses(client: openai.OpenAI, replica) -> None:  # noqa: F811
    """``/v1/responses`` is one of OpenAI's batch endpoints and ferry serves it: a batch of them runs
    and each answer is the endpoint's own; ``background`` is refused as ``stream`` is."""
    body = {
        "model": replica.model_name,
        "input": "What is a ferry?",
        "max_output_tokens": 6,
        "temperature": 0,
    }
    data = (json.dumps(_response_line("r", **body)) + "\n").encode()
    upload = client.files.create(file=("requests.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/responses", completion_window="24h")
    done = _wait(client, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 1, done
    (out,) = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    direct = client.responses.create(**body)
    answer = out["response"]["body"]
    assert out["error"] is None and answer["object"] == "response" and answer["status"] == direct.status
    assert answer["output"][0]["content"][0]["text"] == direct.output_text
    assert answer["usage"]["input_tokens"] == direct.usage.input_tokens
    # The batch's usage sums the Responses API's own usage names.
    assert (done.usage.input_tokens, done.usage.output_tokens) == (
        direct.usage.input_tokens,
        direct.usage.output_tokens,
    )

    background = (json.dumps(_response_line("bg", **body, background=True)) + "\n").encode()
    with pytest.raises(openai.BadRequestError, match="background"):
        client.files.create(file=("requests.jsonl", io.BytesIO(background)), purpose="batch")
