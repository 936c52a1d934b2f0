"""The server announces each generation request to the engine as it comes in, and marks it submitted
whatever becomes of it (served, refused, rejected, abandoned): a request left announced would hold
every later first step of an idle engine for ``arrival_wait_s``.

The app runs in this test's event loop under a real uvicorn on loopback, so the engine's counters
can be read between requests.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import httpx
import openai
import pytest

from engine import SamplingParams
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from server.app import build_app
from server.config import ServerConfig


def _post_scope(path: str) -> dict:
    """The ASGI scope of a JSON POST to ``path``, as uvicorn makes it (the app called directly)."""
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"host", b"t"), (b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
    }  # fmt: skip


@pytest.fixture
async def engine(tiny_llama) -> AsyncIterator[AsyncEngine]:
    eng = AsyncEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=128))
    eng.arrival_wait_s = 30.0  # a request left announced would show as a hang, not as a few ms
    yield eng
    await eng.shutdown()


async def test_every_generation_request_is_announced_and_marked_submitted(engine, serve_app) -> None:
    announced = []
    real_announce = engine.announce

    def counting_announce():
        announced.append(1)
        return real_announce()

    engine.announce = counting_announce  # build_app picks the engine's announce up
    app = build_app(engine, ServerConfig(served_model_name="m"))
    async with serve_app(app) as url:
        sdk = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=30)
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:

            async def settled() -> None:
                # a streamed request ends its ASGI call after its last byte: let it
                deadline = time.monotonic() + 60  # a hang guard only
                while engine.announced != 0:
                    assert time.monotonic() < deadline, f"{engine.announced} requests left announced"
                    await asyncio.sleep(0.01)

            # served: plain, streamed, several choices, chat
            done = await sdk.completions.create(model="m", prompt="hello", max_tokens=3, temperature=0)
            assert done.usage.completion_tokens == 3
            await settled()
            chunks = [
                c
                async for c in await sdk.completions.create(
                    model="m", prompt="hello", max_tokens=3, n=3, stream=True, seed=1
                )
            ]
            assert {c.choices[0].index for c in chunks if c.choices} == {0, 1, 2}
            await settled()
            chat = await sdk.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
            assert chat.usage.completion_tokens == 2
            await settled()
            # refused before the handler (validation) and inside it (context length)
            r = await client.post("/v1/completions", json={"prompt": "x", "temperature": -1})
            assert r.status_code == 400
            r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 10**6})
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
            r = await client.post("/v1/completions", content=b"{not json")
            assert r.status_code == 400
            await settled()
            # abandoned mid-stream
            body = {"prompt": "x", "max_tokens": 500, "ignore_eos": True, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        break
            await settled()
            # not generation routes: never announced
            r = await client.post("/tokenize", json={"prompt": "hello"})
            assert r.status_code == 200
            assert (await client.get("/v1/models")).status_code == 200
    assert len(announced) == 7  # 3 served, 3 refused, 1 abandoned
    assert engine.announced == 0
    # and an idle engine still starts a lone request at once (the 30 s wait would show)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    outs = [o async for o in engine.generate("after", [5, 6, 7], params)]
    out = outs[-1]
    assert out.finished and out.metrics["first_scheduled_time"] - out.metrics["arrival_time"] < 5


async def test_rejected_request_is_marked_submitted(engine, serve_app) -> None:
    # a queue limit of 0: every request is answered 429 by admission, after being announced
    app = build_app(engine, ServerConfig(served_model_name="m", max_queued_requests=0))
    async with serve_app(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 429
        assert r.json()["error"]["type"] == "RateLimitError"
    assert engine.announced == 0


async def test_burst_over_http_completes_with_the_tokens_each_gets_alone(engine, serve_app) -> None:
    engine.arrival_wait_s = engine.config.burst_wait_ms / 1000
    app = build_app(engine, ServerConfig(served_model_name="m"))
    prompts = [[10 + i, 20 + i, 30 + i] for i in range(12)]
    async with serve_app(app) as url, httpx.AsyncClient(base_url=url, timeout=60) as client:

        async def one(prompt: list[int]) -> list[int]:
            body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]

        alone = [await one(p) for p in prompts]
        together = await asyncio.gather(*(one(p) for p in prompts))
    assert together == alone
    assert all(len(t) == 6 for t in alone)
    assert engine.announced == 0


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_a_stream_reaches_the_engine_before_it_writes_a_byte(engine, path: str) -> None:
    """A streamed generation request is submitted before its response starts: the headers go out
    with the first frame (and a chat stream's role chunk with the first output), so a burst's
    requests all reach an idle engine, gathering them, before any of them writes to its socket."""
    events: list[str] = []
    real_start = engine.start

    def start(request_id, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        events.append("submitted")
        return real_start(request_id, *args, **kwargs)

    engine.start = start
    engine.arrival_wait_s = 0.0
    app = build_app(engine, ServerConfig(served_model_name="m"))
    body = {"max_tokens": 2, "temperature": 0, "stream": True}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = [5, 6, 7]
    inbox: asyncio.Queue[dict] = asyncio.Queue()  # the body, then nothing: the client stays
    inbox.put_nowait({"type": "http.request", "body": json.dumps(body).encode(), "more_body": False})
    frames: list[bytes] = []

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            events.append(f"start {message['status']}")
        elif message.get("body"):
            events.append("frame")
            frames.append(message["body"])

    await app(_post_scope(path), inbox.get, send)
    assert events[:3] == ["submitted", "start 200", "frame"]
    # A loaded machine may deliver both tokens in one output: a frame then holds several events.
    events = [e for e in b"".join(frames).split(b"\n\n") if e and e != b"data: [DONE]"]
    sse = [json.loads(e.removeprefix(b"data: ")) for e in events]
    if path.endswith("chat/completions"):
        assert sse[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert sse[1]["choices"][0]["delta"]["content"]
    assert frames[-1].endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("stream", [True, False])
async def test_a_request_is_submitted_in_the_pass_its_handler_ran(engine, stream: bool) -> None:
    """The response (a stream's frames, or a whole answer's collection) runs in the request's own
    task: the request reaches the engine in the event-loop pass that parsed it, not in the next
    one, after every other request of a burst parsed in that pass (the engine process then takes
    a burst in while API servers still parse)."""
    submitted: list[str] = []
    real_start = engine.start

    def start(request_id, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        submitted.append(request_id)
        return real_start(request_id, *args, **kwargs)

    engine.start = start
    engine.arrival_wait_s = 0.0
    app = build_app(engine, ServerConfig(served_model_name="m"))
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0, "stream": stream}).encode()
    finished = asyncio.Event()
    sent: list[dict] = []

    async def receive() -> dict:
        if not sent:
            sent.append({})
            return {"type": "http.request", "body": body, "more_body": False}
        await finished.wait()
        return {"type": "http.disconnect"}

    frames: list[bytes] = []

    async def send(message: dict) -> None:
        if message.get("body"):
            frames.append(message["body"])

    call = asyncio.ensure_future(app(_post_scope("/v1/completions"), receive, send))
    await asyncio.sleep(0)  # one pass: the request's task ran until it waits for its first output
    assert len(submitted) == 1
    await asyncio.wait_for(call, 30)
    finished.set()
    if stream:
        assert frames[-1].endswith(b"data: [DONE]\n\n")
    else:
        assert json.loads(frames[0])["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("n", [1, 2])
async def test_a_stream_ends_in_one_write(engine, path: str, n: int) -> None:
    """The chunk that finishes the last choice, the usage chunk and [DONE] go out with the end of
    the body: one ASGI message (one socket write), not four. Every chunk before goes out alone,
    as it comes."""
    engine.arrival_wait_s = 0.0
    app = build_app(engine, ServerConfig(served_model_name="m"))
    body: dict = {
        "max_tokens": 3, "temperature": 0.8, "seed": 7, "n": n, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = [5, 6, 7]
    inbox: asyncio.Queue[dict] = asyncio.Queue()
    inbox.put_nowait({"type": "http.request", "body": json.dumps(body).encode(), "more_body": False})
    messages: list[dict] = []

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body":
            messages.append(message)

    await app(_post_scope(path), inbox.get, send)
    *each, last = messages
    for message in each:  # one event each, the body going on
        assert message["more_body"] is True and message["body"].count(b"\n\n") == 1
    assert last["more_body"] is False
    events = last["body"].split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""] and len(events) == 4
    finishing, usage = (json.loads(e.removeprefix(b"data: ")) for e in events[:2])
    assert [c["finish_reason"] for c in finishing["choices"]] == ["length"]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3 * n
    finishes = [
        c["finish_reason"]
        for m in each
        for c in json.loads(m["body"].removeprefix(b"data: "))["choices"]
        if c["finish_reason"] is not None
    ]
    assert finishes == ["length"] * (n - 1)  # the other choice finished in a frame of its own
