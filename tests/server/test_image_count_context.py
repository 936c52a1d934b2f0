"""More images than the context holds (each becomes tokens_per_image placeholder tokens) are a 400
before any of them is fetched or decoded: a decoded image may hold ~270 MB of pixels, so a request
of many small files of huge images filled the memory before the prompt's length was checked. The
images here name a closed port: had the server fetched them, the answer would name that failure."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

MAX_MODEL_LEN = 64  # tiny_llava: 16 tokens per image, so 4 images fill it


@pytest.fixture(scope="module")
def short_llava(tiny_llava: Path, serve_logs: Path, server_process) -> Iterator:  # noqa: ANN001
    srv = server_process(tiny_llava, ["--max-model-len", str(MAX_MODEL_LEN)], serve_logs).start()
    yield srv
    srv.stop()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_images_past_the_context_are_refused_before_fetching(short_llava) -> None:  # noqa: ANN001
    url = f"http://127.0.0.1:{_closed_port()}/big.png"
    parts = [{"type": "image_url", "image_url": {"url": url}} for _ in range(5)]
    messages = [{"role": "user", "content": [{"type": "text", "text": "look"}, *parts]}]
    body = {"model": short_llava.model_name, "messages": messages, "max_tokens": 1}
    r = httpx.post(short_llava.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {
        "message": "this request has 5 images of 16 tokens each, more than the model's context of 64 tokens holds",
        "type": "BadRequestError",
        "param": "messages",
        "code": "invalid_value",
    }
    # One image fits: it is fetched (and its fetch fails, the port being closed).
    one = {**body, "messages": [{"role": "user", "content": [parts[0]]}]}
    r = httpx.post(short_llava.url + "/v1/chat/completions", json=one, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == f"could not fetch image {url!r}: ConnectError"
