"""``POST /v1/messages/count_tokens`` on a vision model reads a conversation's images as
``POST /v1/messages`` does: an image that request refuses (base64 that does not decode, data that is
not an image, a URL that cannot be fetched) is the same 400 in Anthropic's shape, not a count of
its placeholder tokens; a good image is counted as the model sees it."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import ServerProcess, free_port
from tests.server.test_llava_serve import QUESTION, png


@pytest.fixture(scope="module")
def vision(tiny_llava: Path, serve_logs: Path) -> Iterator[ServerProcess]:
    srv = ServerProcess(tiny_llava, ["--num-kv-blocks", "64"], serve_logs).start()
    yield srv
    srv.stop()


def _base64(data: str, media_type: str = "image/png") -> dict:
    return {"type": "base64", "media_type": media_type, "data": data}


def _post(srv: ServerProcess, path: str, source: dict) -> httpx.Response:
    messages = [{"role": "user", "content": [{"type": "image", "source": source}, QUESTION]}]
    body: dict = {"model": srv.model_name, "messages": messages}
    if path == "/v1/messages":
        body["max_tokens"] = 2
    return httpx.post(srv.url + path, json=body, timeout=60)


@pytest.mark.parametrize(
    ("source", "needle"),
    [
        (_base64("@@@not-base64@@@"), "does not decode"),
        (_base64(base64.b64encode(b"plain text, not pixels").decode()), "not an image"),
        ({"type": "url", "url": f"http://127.0.0.1:{free_port()}/x.png"}, "could not fetch"),
    ],
)
def test_an_image_messages_refuses_is_refused_by_count_tokens(
    vision: ServerProcess, source: dict, needle: str
) -> None:
    answered = _post(vision, "/v1/messages", source)
    counted = _post(vision, "/v1/messages/count_tokens", source)
    assert answered.status_code == counted.status_code == 400, (answered.text, counted.text)
    assert counted.json()["error"] == answered.json()["error"]  # (each names its own request)
    assert counted.json()["error"]["type"] == "invalid_request_error"
    assert needle in counted.json()["error"]["message"]


def test_a_good_image_is_counted_as_the_model_sees_it(vision: ServerProcess) -> None:
    source = _base64(base64.b64encode(png(4)).decode())
    answered = _post(vision, "/v1/messages", source)
    counted = _post(vision, "/v1/messages/count_tokens", source)
    assert answered.status_code == counted.status_code == 200, (answered.text, counted.text)
    usage = answered.json()["usage"]
    assert counted.json()["input_tokens"] == usage["input_tokens"] + usage["cache_read_input_tokens"]
