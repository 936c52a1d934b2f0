"""`ferry serve` of a vision-language checkpoint served text-only (a tiny Qwen2-VL with a real vision
tower, engine/models/vision_text.py) through the OpenAI SDK: listed by /v1/models, completions and
chat streams answer as the offline engine does, and a chat message carrying an image is a 400 in
OpenAI's error shape that leaves the replica serving."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from engine import LLM, SamplingParams
from tests.server.conftest import ServerProcess

PIXEL = (  # a 1x1 PNG
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQ"
    "IAX8jx0gAAAABJRU5ErkJggg=="
)


@pytest.fixture(scope="module")
def tiny_qwen2_vl_served(models_root: Path) -> Path:
    from engine.demo import build_model

    return build_model(models_root / "qwen2_vl_served", "qwen2_vl", seed=75)


@pytest.fixture(scope="module")
def vl_server(tiny_qwen2_vl_served: Path, serve_logs: Path) -> Iterator[ServerProcess]:
    srv = ServerProcess(tiny_qwen2_vl_served, ["--num-kv-blocks", "64"], serve_logs).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def vl_client(vl_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=vl_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_completion_and_chat_stream(
    vl_server: ServerProcess, vl_client: openai.OpenAI, tiny_qwen2_vl_served: Path
) -> None:
    assert [m.id for m in vl_client.models.list().data] == [vl_server.model_name]
    prompt = [11, 12, 13, 14, 15]
    done = vl_client.completions.create(
        model=vl_server.model_name,
        prompt=prompt,
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    offline = LLM(str(tiny_qwen2_vl_served), num_kv_blocks=16).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    )[0]
    assert done.choices[0].text == offline.outputs[0].text
    assert done.usage is not None and done.usage.completion_tokens == 6
    messages = [{"role": "user", "content": "hello there"}]
    whole = vl_client.chat.completions.create(
        model=vl_server.model_name, messages=messages, max_tokens=8, temperature=0
    )
    stream = vl_client.chat.completions.create(
        model=vl_server.model_name, messages=messages, max_tokens=8, temperature=0, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == whole.choices[0].message.content
    assert whole.usage is not None and whole.usage.completion_tokens > 0


def test_image_part_is_a_400_and_the_replica_keeps_serving(
    vl_server: ServerProcess, vl_client: openai.OpenAI
) -> None:
    content = [{"type": "image_url", "image_url": {"url": PIXEL}}, {"type": "text", "text": "what is this?"}]
    r = httpx.post(
        vl_server.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": content}], "max_tokens": 2},
        timeout=30,
    )
    assert r.status_code == 400
    error = r.json()["error"]
    assert "image content parts are not supported: this model takes text only" in error["message"]
    assert error["param"] == "messages.0"
    assert set(error) >= {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError):  # streamed: refused before any stream starts
        vl_client.chat.completions.create(
            model=vl_server.model_name,
            messages=[{"role": "user", "content": content}],
            max_tokens=2,
            stream=True,
        )
    ok = vl_client.chat.completions.create(
        model=vl_server.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert ok.choices[0].finish_reason in ("length", "stop")
