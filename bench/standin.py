"""A minimal OpenAI-compatible stand-in backend that answers at once (or with a set delay).

Run: ``python bench/standin.py --port P [--tokens 16] [--tokens-per-chunk 1] [--delay-ms 0]
[--ttft-ms 0] [--model-name standin]``.

It exists to measure what sits in front of a backend (the router's proxy overhead, the bench
client itself) without a model's cost in the way: no model, no batching, no scheduler. It is a
raw ASGI app under uvicorn so its own per-request cost stays small.

Its tokenizer is bytes: token id = one UTF-8 byte, so ``/tokenize`` and ``/detokenize`` are exact
and a prompt's token count is its byte count. Answers are ``--tokens`` single-letter tokens (fewer
when the request's ``max_tokens`` is smaller), streamed ``--tokens-per-chunk`` per SSE chunk with
``--delay-ms`` per token and ``--ttft-ms`` before the first; ``stream_options.include_usage`` and
``continuous_usage_stats`` (usage on every chunk) are honoured. ``POST /reset_prefix_cache`` is
accepted (there is no cache) and ``GET /standin/stats`` counts completions, resets and completions per ``X-Session-Id``. It must never load a model or import
anything from ferry, so it runs as a plain script on any machine with uvicorn.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import uvicorn


@dataclass(frozen=True)
class StandInConfig:
    model_name: str = "standin"
    tokens: int = 16
    tokens_per_chunk: int = 1
    delay_ms: float = 0.0
    ttft_ms: float = 0.0
    max_model_len: int = 1 << 20


class BadRequest(Exception):
    pass


def _error_body(message: str, param: str | None = None) -> bytes:
    err = {"message": message, "type": "invalid_request_error", "param": param, "code": None}
    return json.dumps({"error": err}).encode()


def _prompt_tokens(body: dict[str, Any], chat: bool) -> int:
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list")
        total = 0
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            if not isinstance(content, str):
                raise BadRequest("each message needs string content")
            total += len(content.encode())
        return total
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return len(prompt.encode())
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    raise BadRequest("'prompt' must be a string or a list of token ids")


def _max_tokens(body: dict[str, Any], default: int) -> int:
    value = body.get("max_completion_tokens", body.get("max_tokens"))
    if value is None:
        return default
    if not isinstance(value, int) or value < 1:
        raise BadRequest("'max_tokens' must be a positive integer")
    return min(value, default)


class StandIn:
    """The ASGI app: routes by (method, path), answers OpenAI-shaped JSON and SSE."""

    def __init__(self, cfg: StandInConfig) -> None:
        self.cfg = cfg
        self.completions = 0
        self.resets = 0
        self.sessions: dict[str, int] = {}  # X-Session-Id -> completions seen

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        headers = dict(scope["headers"])
        request_id = headers.get(b"x-request-id", uuid.uuid4().hex.encode()).decode()
        try:
            if method == "GET" and path == "/health":
                await self._json(send, 200, {"status": "ok"}, request_id)
            elif method == "GET" and path == "/v1/models":
                model = {
                    "id": self.cfg.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "standin",
                    "max_model_len": self.cfg.max_model_len,
                }
                await self._json(send, 200, {"object": "list", "data": [model]}, request_id)
            elif method == "POST" and path in ("/v1/chat/completions", "/v1/completions"):
                body = await self._body(receive)
                self.completions += 1
                session = headers.get(b"x-session-id")
                if session is not None:
                    key = session.decode()
                    self.sessions[key] = self.sessions.get(key, 0) + 1
                await self._complete(send, body, path == "/v1/chat/completions", request_id)
            elif method == "POST" and path == "/reset_prefix_cache":
                self.resets += 1  # nothing is cached here; counted so clients can be checked
                await self._json(send, 200, {"status": "ok"}, request_id)
            elif method == "GET" and path == "/standin/stats":
                await self._json(
                    send,
                    200,
                    {"completions": self.completions, "resets": self.resets, "sessions": self.sessions},
                    request_id,
                )
            elif method == "POST" and path == "/tokenize":
                body = await self._body(receive)
                text = body.get("prompt")
                if not isinstance(text, str):
                    raise BadRequest("'prompt' must be a string")
                tokens = list(text.encode())
                out = {"tokens": tokens, "count": len(tokens), "max_model_len": self.cfg.max_model_len}
                await self._json(send, 200, out, request_id)
            elif method == "POST" and path == "/detokenize":
                body = await self._body(receive)
                tokens = body.get("tokens")
                if not isinstance(tokens, list) or not all(
                    isinstance(t, int) and 0 <= t < 256 for t in tokens
                ):
                    raise BadRequest("'tokens' must be a list of ids in [0, 256)")
                await self._json(send, 200, {"prompt": bytes(tokens).decode("utf-8", "replace")}, request_id)
            else:
                await self._raw(send, 404, _error_body(f"no route {method} {path}"), request_id)
        except BadRequest as exc:
            await self._raw(send, 400, _error_body(str(exc)), request_id)

    async def _body(self, receive: Any) -> dict[str, Any]:
        chunks = []
        while True:
            msg = await receive()
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        try:
            body = json.loads(b"".join(chunks))
        except ValueError as exc:
            raise BadRequest(f"body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise BadRequest("body must be a JSON object")
        return body

    async def _complete(self, send: Any, body: dict[str, Any], chat: bool, request_id: str) -> None:
        prompt_tokens = _prompt_tokens(body, chat)
        n = _max_tokens(body, self.cfg.tokens)
        finish = "length" if n < self.cfg.tokens else "stop"
        created = int(time.time())
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        obj = "chat.completion" if chat else "text_completion"
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
        text = "".join(chr(ord("a") + i % 26) for i in range(n))
        if not body.get("stream"):
            await self._sleep(self.cfg.ttft_ms + self.cfg.delay_ms * max(n - 1, 0))
            if chat:
                choice = {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": finish,
                }
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            out = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": self.cfg.model_name,
                "choices": [choice],
                "usage": usage,
            }
            await self._json(send, 200, out, request_id)
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream"),
                    (b"cache-control", b"no-cache"),
                    (b"x-request-id", request_id.encode()),
                ],
            }
        )
        obj_chunk = "chat.completion.chunk" if chat else "text_completion"
        options = body.get("stream_options") or {}
        continuous = bool(options.get("continuous_usage_stats"))
        sent = 0  # completion tokens streamed so far (for per-chunk usage)

        async def emit(choices: list[dict], extra: dict | None = None) -> None:
            chunk = {
                "id": rid,
                "object": obj_chunk,
                "created": created,
                "model": self.cfg.model_name,
                "choices": choices,
                **(extra or {}),
            }
            if continuous and "usage" not in chunk:
                chunk["usage"] = {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": sent,
                    "total_tokens": prompt_tokens + sent,
                }
            await send(
                {
                    "type": "http.response.body",
                    "body": b"data: " + json.dumps(chunk).encode() + b"\n\n",
                    "more_body": True,
                }
            )

        if chat:
            await emit([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
        await self._sleep(self.cfg.ttft_ms)
        k = max(1, self.cfg.tokens_per_chunk)
        for start in range(0, n, k):
            if start:
                await self._sleep(self.cfg.delay_ms * min(k, n - start))
            piece = text[start : start + k]
            sent += len(piece)
            last = start + k >= n
            reason = finish if last else None
            if chat:
                await emit([{"index": 0, "delta": {"content": piece}, "finish_reason": reason}])
            else:
                await emit([{"index": 0, "text": piece, "logprobs": None, "finish_reason": reason}])
        if options.get("include_usage"):
            await emit([], {"usage": usage})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    async def _sleep(self, ms: float) -> None:
        if ms > 0:
            await asyncio.sleep(ms / 1000.0)

    async def _json(self, send: Any, status: int, obj: Any, request_id: str) -> None:
        await self._raw(send, status, json.dumps(obj).encode(), request_id)

    async def _raw(self, send: Any, status: int, payload: bytes, request_id: str) -> None:
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
            (b"x-request-id", request_id.encode()),
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="OpenAI-compatible stand-in backend that answers at once.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model-name", default="standin")
    p.add_argument(
        "--tokens", type=int, default=16, help="tokens per response (fewer if max_tokens is smaller)"
    )
    p.add_argument("--tokens-per-chunk", type=int, default=1, help="tokens per SSE chunk")
    p.add_argument("--delay-ms", type=float, default=0.0, help="delay per output token after the first")
    p.add_argument("--ttft-ms", type=float, default=0.0, help="delay before the first token")
    args = p.parse_args(argv)
    if args.tokens < 1 or args.tokens_per_chunk < 1:
        p.error("--tokens and --tokens-per-chunk must be >= 1")
    cfg = StandInConfig(
        model_name=args.model_name,
        tokens=args.tokens,
        tokens_per_chunk=args.tokens_per_chunk,
        delay_ms=args.delay_ms,
        ttft_ms=args.ttft_ms,
    )
    uvicorn.run(
        StandIn(cfg), host=args.host, port=args.port, log_level="warning", access_log=False, lifespan="on"
    )


if __name__ == "__main__":
    main()
