"""`ferry serve` of a LLaVA checkpoint through the OpenAI SDK: images as data URLs, http URLs (a
loopback origin) and file:// URLs under --allowed-local-media-path give the offline engine's answer,
usage counts the image tokens, /tokenize counts them too; and every bad image is a 400 in OpenAI's
error shape that leaves the replica serving, image URLs of hosts outside --allowed-media-domains
before anything is fetched. A text-only model refuses image parts with a 400. Anthropic's image
blocks (in a ``tool_result`` too) reach the model as chat image parts do."""

from __future__ import annotations

import base64
import io
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from engine import LLM, SamplingParams
from engine.media import MediaError, MediaOptions, load_image
from tests.server.conftest import ServerProcess, free_port

QUESTION = {"type": "text", "text": "what is this?"}


def png(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (36, 44, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64," + base64.b64encode(data).decode()


def image_message(*urls: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": [*parts, QUESTION]}]


class _Origin(BaseHTTPRequestHandler):
    files = {"/a.png": (png(1), "image/png"), "/notes.txt": (b"not an image at all", "text/plain")}
    paths: list[str] = []  # every path requested, in order

    def do_GET(self) -> None:  # noqa: N802 - the http.server API
        self.paths.append(self.path)
        if self.path == "/hop.png":  # a redirect to this origin under another host name
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{self.server.server_address[1]}/a.png")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        found = self.files.get(self.path)
        if found is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", found[1])
        self.send_header("Content-Length", str(len(found[0])))
        self.end_headers()
        self.wfile.write(found[0])

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def origin() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Origin)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("media")
    (root / "c.png").write_bytes(png(3))
    return root


@pytest.fixture(scope="module")
def llava_server(tiny_llava: Path, serve_logs: Path, media_dir: Path) -> Iterator[ServerProcess]:
    args = [
        "--num-kv-blocks",
        "64",
        "--limit-mm-per-prompt",
        '{"image": 2}',
        "--allowed-media-domains",
        "127.0.0.1",
    ]
    srv = ServerProcess(tiny_llava, [*args, "--allowed-local-media-path", str(media_dir)], serve_logs).start()
    yield srv
    srv.stop()


def test_image_urls_answer_as_the_offline_engine(
    tiny_llava: Path, llava_server: ServerProcess, origin: str, media_dir: Path
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = LLM(str(tiny_llava), num_kv_blocks=64)
    client = openai.OpenAI(base_url=llava_server.url + "/v1", api_key="x")
    cases = {
        "data URL": (image_message(data_url(png(2))), [png(2)]),
        "http URL": (image_message(f"{origin}/a.png"), [png(1)]),
        "file URL": (image_message((media_dir / "c.png").as_uri()), [png(3)]),
        "two images": (image_message(data_url(png(2)), f"{origin}/a.png"), [png(2), png(1)]),
    }
    for name, (messages, images) in cases.items():
        offline = [{"type": "image_pil", "image_pil": Image.open(io.BytesIO(b))} for b in images]
        want = llm.chat([{"role": "user", "content": [*offline, QUESTION]}], params)[0]
        got = client.chat.completions.create(
            model=llava_server.model_name,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        assert got.choices[0].message.content == want.outputs[0].text, name
        assert got.usage is not None and got.usage.prompt_tokens == len(want.prompt_token_ids), name
        assert want.prompt_token_ids.count(1000) == 16 * len(images)
        # vLLM's prompt_token_ids: the engine's prompt, each image its run of image tokens
        assert got.model_extra["prompt_token_ids"] == list(want.prompt_token_ids), name
    tokenized = httpx.post(
        llava_server.url + "/tokenize", json={"messages": cases["two images"][0]}, timeout=30
    ).json()
    assert tokenized["count"] == got.usage.prompt_tokens
    assert tokenized["tokens"].count(1000) == 32


def test_bad_images_are_400s(llava_server: ServerProcess, origin: str) -> None:
    client = openai.OpenAI(base_url=llava_server.url + "/v1", api_key="x", max_retries=0)
    closed = f"http://127.0.0.1:{free_port()}/x.png"
    cases = {
        "undecodable base64": ("data:image/png;base64,@@@not-base64@@@", "does not decode"),
        "not an image": (data_url(b"plain text, not pixels"), "not an image"),
        "not an image URL type": (data_url(png(2), "text/plain"), "not an image"),
        "not an image over http": (f"{origin}/notes.txt", "not an image"),
        "missing over http": (f"{origin}/missing.png", "HTTP 404"),
        "unreachable": (closed, "could not fetch"),
        "file outside the media path": ("file:///etc/hostname", "outside the allowed local media path"),
        "unknown scheme": ("ftp://example.com/a.png", "only data:"),
    }
    for name, (url, message) in cases.items():
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model=llava_server.model_name,
                messages=image_message(url),
                max_tokens=2,  # type: ignore[arg-type]
            )
        assert err.value.status_code == 400, name
        body = err.value.body
        assert isinstance(body, dict) and message in body["message"], (name, body)
        assert body["type"] == "BadRequestError" or body["type"] == "invalid_request_error", body
    three = image_message(*[data_url(png(i)) for i in range(3)])
    r = httpx.post(
        llava_server.url + "/v1/chat/completions", json={"messages": three, "max_tokens": 2}, timeout=30
    )
    assert r.status_code == 400
    assert "3 images, more than the 2 allowed" in r.json()["error"]["message"]
    # The replica still serves.
    ok = client.chat.completions.create(
        model=llava_server.model_name,
        messages=image_message(data_url(png(2))),
        max_tokens=2,  # type: ignore[arg-type]
    )
    assert ok.choices[0].finish_reason == "length"


def test_media_domains_refuse_other_hosts_before_fetching(llava_server: ServerProcess, origin: str) -> None:
    """--allowed-media-domains 127.0.0.1: the same origin named as localhost is a 400 before any
    image of the request is fetched; a redirect to another host is refused before it is followed."""
    port = origin.rsplit(":", 1)[1]
    elsewhere = f"http://localhost:{port}/a.png"
    _Origin.paths.clear()
    chat = {"model": llava_server.model_name, "max_tokens": 2}
    for urls, fetched in (((f"{origin}/a.png", elsewhere), []), ((f"{origin}/hop.png",), ["/hop.png"])):
        r = httpx.post(
            llava_server.url + "/v1/chat/completions",
            json={**chat, "messages": image_message(*urls)},
            timeout=30,
        )
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert "localhost is not one of the server's allowed media domains (127.0.0.1)" in message, message
        assert _Origin.paths == fetched
    # The offline path (LLM.chat) checks the same way.
    allowed = MediaOptions(allowed_media_domains=("127.0.0.1",))
    with pytest.raises(MediaError, match="localhost is not one of"):
        load_image(elsewhere, allowed)
    assert load_image(f"{origin}/a.png", allowed).size == (44, 36)


def test_beam_search_over_an_image_prompt_equals_offline(
    tiny_llava: Path, llava_server: ServerProcess
) -> None:
    """vLLM's use_beam_search with image parts: every beam of every step carries the images (processed
    once: the engine keeps processed images by their bytes); the beams are the offline engine's."""
    from engine.beam_search import BeamSearchParams

    messages = image_message(data_url(png(8)))
    prompt = httpx.post(llava_server.url + "/tokenize", json={"messages": messages}, timeout=30).json()[
        "tokens"
    ]
    client = openai.OpenAI(base_url=llava_server.url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(
        model=llava_server.model_name,
        messages=messages,  # type: ignore[arg-type]
        n=2,
        max_tokens=5,
        extra_body={"use_beam_search": True, "ignore_eos": True, "return_token_ids": True},
    )
    llm = LLM(str(tiny_llava), num_kv_blocks=64)
    image = Image.open(io.BytesIO(png(8)))
    beams = llm.beam_search(
        [{"prompt_token_ids": prompt, "multi_modal_data": {"image": image}}],
        BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True),
    )[0].sequences
    assert prompt.count(1000) == 16  # /tokenize counts the expanded run
    assert [c.token_ids for c in r.choices] == [b.tokens[len(prompt) :] for b in beams]
    assert r.usage is not None and r.usage.prompt_tokens == len(prompt)


def test_text_only_model_refuses_image_parts(server: ServerProcess) -> None:
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": image_message(data_url(png(2))), "max_tokens": 2},
        timeout=30,
    )
    assert r.status_code == 400
    error = r.json()["error"]
    assert "this model takes text only" in error["message"]
    assert set(error) >= {"message", "type", "param", "code"}


def test_responses_and_messages_take_images(tiny_llava: Path, llava_server: ServerProcess) -> None:
    """The Responses API's ``input_image`` and Anthropic's base64 ``image`` block reach the model as
    a chat ``image_url`` part does: the same prompt (usage) and the same greedy answer."""
    import anthropic

    image = png(5)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    offline = {"type": "image_pil", "image_pil": Image.open(io.BytesIO(image))}
    want = LLM(str(tiny_llava), num_kv_blocks=64).chat(
        [{"role": "user", "content": [offline, QUESTION]}], params
    )[0]
    client = openai.OpenAI(base_url=llava_server.url + "/v1", api_key="x")
    content = [
        {"type": "input_image", "image_url": data_url(image)},
        {"type": "input_text", "text": "what is this?"},
    ]
    r = client.responses.create(
        model=llava_server.model_name,
        input=[{"role": "user", "content": content}],  # type: ignore[list-item]
        max_output_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
        store=False,
    )
    assert r.output_text == want.outputs[0].text
    assert r.usage is not None and r.usage.input_tokens == len(want.prompt_token_ids)
    block = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(image).decode()}
    messages = [{"role": "user", "content": [{"type": "image", "source": block}, QUESTION]}]
    claude = anthropic.Anthropic(base_url=llava_server.url, api_key="x", max_retries=0)
    m = claude.messages.create(
        model=llava_server.model_name,
        max_tokens=8,
        messages=messages,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True, "temperature": 0},
    )
    assert m.content[0].text == want.outputs[0].text  # type: ignore[union-attr]
    # The same image and text as the Responses request: its two full blocks come from the cache.
    assert m.usage.cache_read_input_tokens == 32
    assert m.usage.input_tokens + 32 == len(want.prompt_token_ids)
    counted = claude.messages.count_tokens(model=llava_server.model_name, messages=messages)  # type: ignore[arg-type]
    assert counted.input_tokens == len(want.prompt_token_ids)


def test_images_cross_to_the_engine_process(tiny_llava: Path, serve_logs: Path) -> None:
    """With --api-server-count 2 the images travel to the engine process (and are processed there
    off its event loop): the same answer as one process gives."""
    messages = image_message(data_url(png(6)))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    offline = {"type": "image_pil", "image_pil": Image.open(io.BytesIO(png(6)))}
    want = LLM(str(tiny_llava), num_kv_blocks=64).chat(
        [{"role": "user", "content": [offline, QUESTION]}], params
    )[0]
    srv = ServerProcess(tiny_llava, ["--num-kv-blocks", "64", "--api-server-count", "2"], serve_logs).start()
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
        for _ in range(2):  # both API servers, whichever takes each connection
            got = client.chat.completions.create(
                model=srv.model_name,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=8,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert got.choices[0].message.content == want.outputs[0].text
            assert got.usage is not None and got.usage.prompt_tokens == len(want.prompt_token_ids)
    finally:
        srv.stop()


def test_an_image_in_a_tool_result_reaches_the_model(llava_server: ServerProcess) -> None:
    """Anthropic's ``tool_result`` may hold image blocks: they reach the model as image parts of the
    user's turn after the tool message (OpenAI's tool messages take text only), as vLLM's Messages
    API puts them: the same prompt and greedy answer as that chat conversation."""
    import anthropic

    image = png(7)
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(image).decode()}
    call = {"type": "tool_use", "id": "toolu_1", "name": "screenshot", "input": {}}

    def conversation(*result: dict) -> list[dict]:
        return [
            {"role": "user", "content": "Take a screenshot."},
            {"role": "assistant", "content": [{"type": "text", "text": "Taking it."}, call]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [*result]},
                    QUESTION,
                ],
            },
        ]

    messages = conversation({"type": "text", "text": "done"}, {"type": "image", "source": source})
    claude = anthropic.Anthropic(base_url=llava_server.url, api_key="x", max_retries=0)
    m = claude.messages.create(
        model=llava_server.model_name,
        max_tokens=8,
        messages=messages,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True, "temperature": 0},
    )
    chat_messages = [
        {"role": "user", "content": "Take a screenshot."},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Taking it."}],
            "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": "screenshot", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "done"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}}, QUESTION]},
    ]
    chat = openai.OpenAI(base_url=llava_server.url + "/v1", api_key="x").chat.completions.create(
        model=llava_server.model_name,
        messages=chat_messages,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert m.content[0].text == chat.choices[0].message.content  # type: ignore[union-attr]
    assert chat.usage is not None
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == chat.usage.prompt_tokens
    counted = claude.messages.count_tokens(model=llava_server.model_name, messages=messages)  # type: ignore[arg-type]
    text_only = claude.messages.count_tokens(
        model=llava_server.model_name,
        messages=conversation({"type": "text", "text": "done"}),  # type: ignore[arg-type]
    )
    assert counted.input_tokens == chat.usage.prompt_tokens == text_only.input_tokens + 16  # the image's run
