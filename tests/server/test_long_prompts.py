"""A long prompt is tokenized without stopping the rest of the replica: its request is planned on a
worker thread (``serving_common.plan_off_loop``), and `tokenizers` encodes it without holding the
GIL (``engine.tokenizer.encoding``), so the event loop relays other streams and the engine steps
meanwhile. bench/long_prompt_stall.py measures the stall this saves."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator

import httpx
import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.tokenizer import GIL_FREE_CHARS, encoding
from server.app import build_app
from server.config import ServerConfig
from server.serving_common import OFFLOAD_CHARS, prompt_chars

LONG = "the quick brown fox jumps over the lazy dog " * 2000  # 88k characters


def test_a_long_text_is_encoded_without_holding_the_gil(tokenizer) -> None:
    text = LONG * 12  # ~1 MB: about a second of encoding here
    ticks = 0
    stop = threading.Event()

    def tick() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            stop.wait(0.001)

    encoded = threading.Event()

    def encode() -> list[int]:
        try:
            return encoding(tokenizer.backend, text, False).ids
        finally:
            encoded.set()

    ticker = threading.Thread(target=tick)
    result: list[list[int]] = []
    worker = threading.Thread(target=lambda: result.append(encode()))
    worker.start()
    ticker.start()  # started after the encode: it runs only if the GIL is let go
    encoded.wait(60)
    during = ticks
    stop.set()
    worker.join()
    ticker.join()
    assert during >= 20
    # The same ids as the plain encode, for long and short texts alike.
    assert result[0] == tokenizer.backend.encode(text, add_special_tokens=False).ids
    short = LONG[:GIL_FREE_CHARS]
    assert encoding(tokenizer.backend, short, True).ids == tokenizer.backend.encode(short).ids


def test_prompt_chars_counts_the_text_of_any_request_shape() -> None:
    assert prompt_chars("abc") == 3
    assert prompt_chars([[1, 2, 3], [4]]) == 0  # token ids
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "hello"}]},
        {"role": "x", "content": "ab"},
    ]
    assert prompt_chars(messages) == len("user") + len("text") + 5 + 1 + 2


@pytest.fixture(scope="module")
async def engine(tiny_llama) -> AsyncIterator[AsyncEngine]:
    eng = AsyncEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=128))
    yield eng
    await eng.shutdown()


@pytest.mark.parametrize(
    "path",
    ["/v1/completions", "/v1/chat/completions", "/tokenize", "/v1/messages/count_tokens", "/v1/embeddings"],
)
async def test_a_long_prompt_is_planned_off_the_event_loop(engine, serve_app, path: str) -> None:
    app = build_app(engine, ServerConfig(served_model_name="m"))
    tokenizer = app.state.ferry.tokenizer
    threads: list[tuple[int, int]] = []  # (characters, thread) of each encode
    plain = tokenizer.encode

    def spy(text: str, add_special_tokens: bool = True) -> list[int]:
        threads.append((len(text), threading.get_ident()))
        return plain(text, add_special_tokens)

    tokenizer.encode = spy
    try:
        loop_thread = threading.get_ident()  # serve_app runs uvicorn on this test's loop
        async with serve_app(app) as url, httpx.AsyncClient(base_url=url, timeout=60) as client:
            for text in ("short prompt", LONG):
                chat = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 2}
                body = {
                    "/v1/completions": {"model": "m", "prompt": text, "max_tokens": 2},
                    "/tokenize": {"model": "m", "prompt": text},
                    "/v1/embeddings": {"model": "m", "input": text},
                }.get(path, chat)
                r = await client.post(path, json=body)
                past_context = text == LONG and path not in ("/tokenize", "/v1/messages/count_tokens")
                assert r.status_code == (400 if past_context else 200), r.text
    finally:
        tokenizer.encode = plain
    short, long = [t for t in threads if t[0] < OFFLOAD_CHARS], [t for t in threads if t[0] > OFFLOAD_CHARS]
    assert short and long
    assert all(thread == loop_thread for _, thread in short)  # a short prompt: no thread hop
    assert all(thread != loop_thread for _, thread in long)
