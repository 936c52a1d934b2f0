"""A scripted replica for router tests: an HTTP/1.1 server in the test's process that answers
``/health`` and ``/v1/models`` as a ferry replica does and plays a script on each generation
request, for what a real replica does only at the wrong moment (an engine that dies after the
second token, a process that hangs right after the router let it go, a /v1/models that never comes).

A stream plays ``script_for(path, body)`` when that is set, else ``script`` (or the next of
``scripts``): bytes are SSE events sent as they are;
``GATE`` waits for ``release()``; ``HANG`` makes the replica stop answering (``/health`` answers
503, the stream's connection is held open, silent); ``DONE`` ends the body cleanly. A script
without ``DONE`` or ``HANG`` ends with the connection closed mid-body (the process died). A whole
answer is ``whole`` (its status ``whole_status``, with ``whole_headers``). Every generation
request's body is kept in ``bodies``, every request's method and path in ``requests``; a request
to one of ``broken_paths`` is read and its connection closed unanswered; ``models_delay`` slows
``/v1/models``.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Sequence
from typing import Any

from router_harness import free_port

GATE, HANG, DONE = "gate", "hang", "done"
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses")


def data_event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def named_event(kind: str, obj: dict) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + json.dumps(obj).encode() + b"\n\n"


def text_chunk(text: str, token_id: int, finish: str | None = None, chat: bool = False) -> bytes:
    """A completions (or chat) chunk with one choice carrying its token id, as a ferry replica
    asked for ``return_token_ids`` sends it."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "token_ids": [token_id]}
    if chat:
        choice["delta"] = {"content": text}
    else:
        choice["text"] = text
    return data_event({"id": "cmpl-1", "created": 1, "model": "m", "choices": [choice]})


class ScriptedReplica:
    def __init__(self, models: tuple[str, ...] = ("m",)) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.health_body: dict[str, Any] = {"status": "ok"}
        self.models = {"object": "list", "data": [{"id": m, "object": "model"} for m in models]}
        self.models_hang = False  # /v1/models never answers
        self.models_delay = 0.0  # seconds /v1/models takes to answer
        self.broken_paths: set[str] = set()  # requests to these are read, then the connection closed
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request, in order
        self.script: list[bytes | str] = [DONE]
        self.scripts: list[list[bytes | str]] = []  # per stream request, before ``script``
        self.script_for: Callable[[str, dict], list[bytes | str]] | None = None
        self.whole: dict[str, Any] = {"id": "w", "choices": [{"index": 0, "text": "whole"}]}
        self.whole_status = b"200 OK"  # a whole answer's status line and extra headers
        self.whole_headers: list[tuple[bytes, bytes]] = []
        self.hung = False
        self.bodies: list[dict] = []
        self._tasks: set[asyncio.Task] = set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()
        assert self._ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._gate = asyncio.Event()
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", self.port)
        )
        self._ready.set()
        self._loop.run_forever()

    def release(self) -> None:
        """Let every stream waiting at a ``GATE`` go on."""
        self._loop.call_soon_threadsafe(self._gate.set)

    def hold(self) -> None:
        """Make ``GATE`` wait again after a ``release()``."""
        asyncio.run_coroutine_threadsafe(self._clear_gate(), self._loop).result(10)

    async def _clear_gate(self) -> None:
        self._gate.clear()

    def stop_listening(self) -> None:
        """Nothing listens on the port any more (connections are refused); open ones stay."""
        asyncio.run_coroutine_threadsafe(self._close_server(), self._loop).result(10)

    async def _close_server(self) -> None:
        self._server.close()
        await self._server.wait_closed()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)

    async def _stop(self) -> None:
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._loop.call_soon(self._loop.stop)

    @staticmethod
    def _answer(
        status: bytes,
        body: bytes,
        content_type: bytes = b"application/json",
        headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> bytes:
        head = b"HTTP/1.1 " + status + b"\r\ncontent-type: " + content_type
        head += b"".join(b"\r\n" + k + b": " + v for k, v in headers)
        return head + b"\r\ncontent-length: %d\r\n\r\n" % len(body) + body

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            while await self._exchange(reader, writer):
                pass
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
            self._tasks.discard(task)

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """One request and its answer; False when the connection is done."""
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        path = head[0].split(" ")[1]
        headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:] if h)}
        raw = await reader.readexactly(int(headers.get("content-length", 0)))
        self.requests.append((head[0].split(" ")[0], path))
        if path in self.broken_paths:
            return False
        if path == "/health":
            if self.hung:
                writer.write(self._answer(b"503 Service Unavailable", b'{"error": "hung"}'))
            else:
                writer.write(self._answer(b"200 OK", json.dumps(self.health_body).encode()))
        elif path == "/v1/models":
            if self.models_hang:
                await reader.read()  # until the router gives up and closes
                return False
            await asyncio.sleep(self.models_delay)
            writer.write(self._answer(b"200 OK", json.dumps(self.models).encode()))
        elif path in GENERATION_PATHS:
            body = json.loads(raw)
            self.bodies.append(body)
            if body.get("stream"):
                return await self._stream(reader, writer, path, body)
            whole = json.dumps(self.whole).encode()
            writer.write(self._answer(self.whole_status, whole, headers=self.whole_headers))
        else:
            writer.write(self._answer(b"404 Not Found", b'{"error": "no route"}'))
        await writer.drain()
        return True

    async def _stream(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str, body: dict
    ) -> bool:
        if self.script_for is not None:
            script = self.script_for(path, body)
        else:
            script = self.scripts.pop(0) if self.scripts else self.script
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        await writer.drain()
        for step in script:
            if step == GATE:
                await self._gate.wait()
            elif step == HANG:
                self.hung = True
                await reader.read()  # silent until the router drops the connection
                return False
            elif step == DONE:
                writer.write(b"0\r\n\r\n")
                await writer.drain()
                return True
            else:
                assert isinstance(step, bytes)
                writer.write(b"%x\r\n%s\r\n" % (len(step), step))
                await writer.drain()
        return False  # mid-body: the connection closes
