"""Prefill/decode disaggregation of a chat request with images (a LLaVA checkpoint).

An image's content digest is part of the hashes of the blocks its placeholder run touches (a
router reading the same data URL keys the prompt alike): the prefill worker's answer lists the hashes its engine computed, the decode
worker's engine checks the listed hashes against its own (a list computed without the images is a
400) and loads the blocks from the tier. Through a PD router the answer, streamed or not, is the
offline engine's.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from PIL import Image

from engine import LLM, SamplingParams
from kvcache.keys import block_hashes, to_hex
from router.prompt_keys import TokenKeyer
from tests.router.router_harness import Proc, free_port, metric, replica_args
from tests.server.test_llava_serve import data_url, image_message, png


@pytest.fixture(scope="module")
def llava_pd(tiny_llava: Path, redis_server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    redis_server.flush()
    tmp = tmp_path_factory.mktemp("pd-llava")
    tier = ("--kv-tier", redis_server.url, "--num-kv-blocks", "128")
    procs: list[Proc] = []
    try:
        for role in ("prefill", "decode"):
            port = free_port()
            args = replica_args(tiny_llava, port, "--role", role, *tier)
            procs.append(Proc(args, port, tmp / f"{role}-{port}.log").start())
        for p in procs:
            p.wait_http(180.0)
        port = free_port()
        router = Proc(
            [
                "router",
                "--port",
                str(port),
                "--health-interval",
                "0.2",
                "--model",
                str(tiny_llava),
                "--pd-threshold",
                "1",
                "--prefill",
                procs[0].url,
                "--decode",
                procs[1].url,
            ],
            port,
            tmp / f"router-{port}.log",
        ).start()
        procs.append(router)
        router.wait_http(30.0)
        yield {"prefill": procs[0], "decode": procs[1], "router": router}
    finally:
        for p in reversed(procs):
            p.stop()


def _offline(tiny_llava: Path, image: bytes, max_tokens: int):
    llm = LLM(str(tiny_llava), num_kv_blocks=64, deterministic=True)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    offline = {"type": "image_pil", "image_pil": Image.open(io.BytesIO(image))}
    message = image_message("x")[0]
    content = [offline, *message["content"][1:]]
    return llm.chat([{"role": "user", "content": content}], params)[0]


def test_replicas_hand_off_an_image_prompt(tiny_llava: Path, llava_pd: dict) -> None:
    prefill, decode = llava_pd["prefill"], llava_pd["decode"]
    messages = image_message(data_url(png(5)))
    want = _offline(tiny_llava, png(5), 6)
    ids = want.prompt_token_ids
    name = httpx.get(prefill.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    common = {"model": name, "messages": messages, "temperature": 0, "ignore_eos": True}
    first = httpx.post(
        prefill.url + "/v1/chat/completions",
        json={**common, "max_tokens": 1, "return_token_ids": True, "kv_transfer": {"role": "producer"}},
        timeout=60,
    ).json()
    assert "kv_transfer" in first, first
    listed = first["kv_transfer"]["block_hashes"]
    full = len(ids) // 16
    assert len(listed) == full >= 1
    # The pixels are in the hashes: the text-only hashes of the same tokens differ from the first block.
    text_only = to_hex(block_hashes(ids, 16))
    assert listed[0] != text_only[0]
    # A router reading the same body keys it exactly as the engine did (images by their bytes).
    keyer = TokenKeyer.from_dir(str(tiny_llava), 16)
    keys, count = keyer.keys("/v1/chat/completions", {"messages": messages})
    assert to_hex(keys) == listed and count == len(ids)
    token = first["choices"][0]["token_ids"]
    assert token == want.outputs[0].token_ids[:1]

    consumer = {**common, "max_tokens": 6, "return_token_ids": True, "resume": {"token_ids": token}}
    wrong = httpx.post(
        decode.url + "/v1/chat/completions",
        json={**consumer, "kv_transfer": {"role": "consumer", "block_hashes": text_only}},
        timeout=60,
    )
    assert wrong.status_code == 400
    assert "not the leading block hashes of this prompt with its images" in wrong.json()["error"]["message"]
    rest = httpx.post(
        decode.url + "/v1/chat/completions",
        json={**consumer, "kv_transfer": {"role": "consumer", "block_hashes": listed}},
        timeout=60,
    ).json()
    # the decode worker never saw this prompt: every full block (image run included) came from the tier
    assert rest["usage"]["prompt_tokens_details"]["cached_tokens"] == full * 16
    assert token + rest["choices"][0]["token_ids"] == want.outputs[0].token_ids
    assert httpx.get(decode.url + "/health", timeout=10).status_code == 200


def test_router_disaggregates_image_chat(tiny_llava: Path, llava_pd: dict) -> None:
    router = llava_pd["router"]
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    name = client.models.list().data[0].id
    before = metric(router.url, "ferry:router_pd_requests_total", {"path": "disaggregated"})
    for seed, stream in ((6, False), (7, True)):
        want = _offline(tiny_llava, png(seed), 8)
        kwargs = {
            "model": name,
            "messages": image_message(data_url(png(seed))),
            "max_tokens": 8,
            "temperature": 0,
            "extra_body": {"ignore_eos": True},
        }
        if stream:
            chunks = client.chat.completions.create(stream=True, **kwargs)  # type: ignore[call-overload]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            text = client.chat.completions.create(**kwargs).choices[0].message.content  # type: ignore[call-overload]
        assert text == want.outputs[0].text, stream
    assert metric(router.url, "ferry:router_pd_requests_total", {"path": "disaggregated"}) - before == 2
