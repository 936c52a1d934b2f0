"""The soak's load (``bench/soak.py``): a raw HTTP/1.1 client that can hang up at any point, a
kept-alive one (httpx), and the request mix — every generation endpoint, streamed and not, with the
options that take other paths through the server (``n > 1``, logprobs, stop strings, structured
outputs, tool calls, beam search, background responses and their cancel) and bodies that are
refused. Loopback only."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from typing import Any

import httpx

MODEL = "soak"
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
WORDS = "the quick brown fox jumps over a lazy dog while seven ships sail past old harbours".split()


# ---------------------------------------------------------------- a raw HTTP/1.1 client


async def http(
    method: str,
    port: int,
    path: str,
    body: bytes | None = None,
    *,
    timeout: float = 120.0,
    hang_up: str | None = None,
    rng: random.Random | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """One request on its own connection (``Connection: close``). ``hang_up``: ``before`` (close
    right after sending), ``head`` (after the status line), ``mid`` (after a random part of the
    body), ``end`` (a few bytes before the end). Answers (status, headers, body); status 0 when the
    client hung up."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
        if body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        writer.write(head.encode() + b"\r\n" + (body or b""))
        await writer.drain()
        if hang_up == "before":
            return 0, {}, b""
        async with asyncio.timeout(timeout):
            status_line = await reader.readline()
            if hang_up == "head":
                return 0, {}, b""
            headers: dict[str, str] = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                key, _, value = line.decode().partition(":")
                headers[key.strip().lower()] = value.strip()
            if hang_up == "mid":
                await reader.read(rng.randint(1, 400) if rng else 100)
                return 0, headers, b""
            data = await reader.read()
            if hang_up == "end":
                return 0, headers, b""
        status = int(status_line.split()[1])
        if headers.get("transfer-encoding") == "chunked":
            data = dechunk(data)
        return status, headers, data
    finally:
        writer.close()


async def http_pooled(
    client: httpx.AsyncClient, port: int, path: str, body: bytes, hang: str | None, rng: random.Random
) -> tuple[int, bytes]:
    """A POST on a kept-alive connection; a hang-up leaves the answer unread, which closes that
    connection (``before`` and ``head`` both leave right after the status line here)."""
    url = f"http://127.0.0.1:{port}{path}"
    headers = {"content-type": "application/json"}
    async with client.stream("POST", url, content=body, headers=headers) as response:
        if hang in ("before", "head"):
            return 0, b""
        if hang in ("mid", "end"):
            want = rng.randint(1, 400) if hang == "mid" else 1 << 30
            got = 0
            async for chunk in response.aiter_raw():
                got += len(chunk)
                if got >= want:
                    break
            return 0, b""
        return response.status_code, await response.aread()


def dechunk(data: bytes) -> bytes:
    out, i = bytearray(), 0
    while i < len(data):
        j = data.index(b"\r\n", i)
        size = int(data[i:j].split(b";")[0], 16)
        if size == 0:
            break
        out += data[j + 2 : j + 2 + size]
        i = j + 2 + size + 2
    return bytes(out)


# ---------------------------------------------------------------- the request mix


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60)))


def make_request(rng: random.Random) -> tuple[str, str, bytes]:
    """(kind, path, body) of one random request."""
    kind = rng.choices(
        [
            "completion",
            "chat",
            "chat_json",
            "chat_tools",
            "responses",
            "bg_cancel",
            "messages",
            "beam",
            "bg_stream",
            "long",
            "bad",
        ],
        weights=[22, 22, 9, 9, 13, 2, 6, 2, 2, 2, 13],
    )[0]
    stream = rng.random() < 0.6
    max_tokens = rng.randint(1, 24)
    if kind == "bad":
        return kind, *rng.choice(bad_bodies())
    if kind == "completion":
        body: dict[str, Any] = {
            "model": MODEL,
            "prompt": prompt(rng),
            "max_tokens": max_tokens,
            "stream": stream,
            "n": rng.choice([1, 1, 2, 3]),
        }
        if rng.random() < 0.4:
            body["logprobs"] = rng.randint(0, 3)
        if rng.random() < 0.3:
            body["stop"] = [rng.choice(WORDS), "e"]
        if rng.random() < 0.2:
            body["echo"] = True
        return kind, "/v1/completions", json.dumps(body).encode()
    if kind == "messages":
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt(rng)}],
            "max_tokens": max_tokens,
            "stream": stream,
        }
        if rng.random() < 0.3:
            body["tools"] = [{"name": "get_weather", "input_schema": WEATHER}]
            body["tool_choice"] = {"type": "any"}
            body["max_tokens"] = 40
        return kind, "/v1/messages", json.dumps(body).encode()
    if kind == "long":  # over replica b's --request-timeout: a 408, or a stream ended by an error
        body = {
            "model": MODEL,
            "prompt": prompt(rng),
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": stream,
        }
        return kind, "/v1/completions", json.dumps(body).encode()
    if kind == "bg_cancel":  # a background response, cancelled as soon as it is queued
        body = {
            "model": MODEL,
            "input": prompt(rng),
            "max_output_tokens": 200,
            "store": True,
            "background": True,
        }
        return kind, "/v1/responses", json.dumps(body).encode()
    if kind == "bg_stream":  # a streamed background response: it runs on when its client leaves
        body = {
            "model": MODEL,
            "input": prompt(rng),
            "max_output_tokens": 100,
            "store": True,
            "background": True,
            "stream": True,
        }
        return kind, "/v1/responses", json.dumps(body).encode()
    if kind == "beam":
        body = {
            "model": MODEL,
            "prompt": prompt(rng),
            "max_tokens": max_tokens,
            "stream": stream,
            "use_beam_search": True,
            "n": rng.choice([1, 2, 3]),
        }
        return kind, "/v1/completions", json.dumps(body).encode()
    if kind == "responses":
        store = rng.random() < 0.15
        body = {
            "model": MODEL,
            "input": prompt(rng),
            "max_output_tokens": max_tokens + 1,
            "stream": stream,
            "store": store,
        }
        if store and rng.random() < 0.4:
            body["background"] = True
        if rng.random() < 0.3:
            body["text"] = {"format": {"type": "json_schema", "name": "w", "schema": WEATHER}}
            body["max_output_tokens"] = 40
        return kind, "/v1/responses", json.dumps(body).encode()
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt(rng)}],
        "max_tokens": max_tokens,
        "stream": stream,
        "n": rng.choice([1, 1, 2]),
    }
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": rng.random() < 0.5}
    if rng.random() < 0.3:
        body["logprobs"] = True
        body["top_logprobs"] = rng.randint(0, 3)
    if rng.random() < 0.3:
        body["stop"] = rng.choice(WORDS)
    if kind == "chat_json":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
        body["max_tokens"] = 40
    if kind == "chat_tools":
        body["tools"] = TOOLS
        body["tool_choice"] = rng.choice(
            ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}]
        )
        body["max_tokens"] = 40
    return kind, "/v1/chat/completions", json.dumps(body).encode()


def bad_bodies() -> list[tuple[str, bytes]]:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    return [
        ("/v1/chat/completions", b"{not json"),
        ("/v1/chat/completions", json.dumps({**chat, "max_tokens": -1}).encode()),
        ("/v1/chat/completions", json.dumps({**chat, "stream": True, "n": 0}).encode()),
        ("/v1/chat/completions", json.dumps({**chat, "model": "nope"}).encode()),
        ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 100000}).encode()),
        ("/v1/completions", json.dumps({"model": MODEL, "prompt": [], "stream": True}).encode()),
        ("/v1/responses", json.dumps({"model": MODEL, "input": [{"role": "bogus"}]}).encode()),
        (
            "/v1/chat/completions",
            json.dumps(
                {
                    **chat,
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "x", "schema": {"type": "bogus"}},
                    },
                }
            ).encode(),
        ),
    ]


async def run_load(args: argparse.Namespace, ports: dict[str, int]) -> dict[str, Any]:
    rng = random.Random(args.seed)
    plan = []
    for i in range(args.requests):
        target = rng.choices(["router", "a", "b"], weights=[70, 15, 15])[0]
        hang = rng.choices([None, "before", "head", "mid", "end"], weights=[70, 8, 7, 8, 7])[0]
        plan.append((i, target, hang, *make_request(rng)))
    statuses: dict[str, int] = {}
    queue: asyncio.Queue = asyncio.Queue()
    for item in plan:
        queue.put_nowait(item)

    async def worker(wid: int) -> None:
        wrng = random.Random(args.seed * 1000 + wid)
        # Half the workers keep their connections alive between requests (as SDKs do).
        pooled = httpx.AsyncClient(timeout=120) if wid % 2 else None
        while not queue.empty():
            _, target, hang, kind, path, body = queue.get_nowait()
            try:
                if pooled is not None:
                    status, answer = await http_pooled(pooled, ports[target], path, body, hang, wrng)
                else:
                    status, _, answer = await http(
                        "POST", ports[target], path, body, hang_up=hang, rng=wrng, timeout=120
                    )
                key = f"{target}:{'hangup-' + hang if hang else status}"
                if kind == "bg_cancel" and status == 200:
                    rid = json.loads(answer)["id"]
                    status, _, _ = await http("POST", ports[target], f"/v1/responses/{rid}/cancel", b"{}")
                    key = f"{target}:cancel-{status}"
            except (OSError, asyncio.TimeoutError, ValueError, IndexError, httpx.HTTPError) as e:
                key = f"{target}:exc-{type(e).__name__}"
            statuses[key] = statuses.get(key, 0) + 1
        if pooled is not None:
            await pooled.aclose()

    start = time.monotonic()
    await asyncio.gather(*(worker(w) for w in range(args.concurrency)))
    return {"seconds": round(time.monotonic() - start, 1), "statuses": dict(sorted(statuses.items()))}
