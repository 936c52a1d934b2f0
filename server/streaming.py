"""Server-sent events and client-disconnect handling.

``SSEResponse`` sends ``data: <json>\\n\\n`` frames from an async iterator while watching
``receive`` for ``http.disconnect``; when the client goes, the iterator is cancelled at once
(its ``finally`` aborts the engine request), not at the next token. ``run_or_disconnect`` does
the same for non-streaming requests.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from starlette.responses import Response, StreamingResponse

from server.errors import APIError
from server.middleware import Receive, Scope, Send

logger = logging.getLogger("ferry.server")

T = TypeVar("T")

DONE_FRAME = b"data: [DONE]\n\n"
# A stream's headers; a PD router writing a stream itself sends the same (router/pd.py).
SSE_HEADERS = (
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
    (b"content-type", b"text/event-stream; charset=utf-8"),
)


class FinalFrames(bytes):
    """A stream's last frames: ``SSEResponse`` sends them with the end of the body, as one write
    (a generation stream's last token, usage and ``[DONE]``: one write instead of three). Its
    iterator must end after yielding it."""


def sse_frame(payload: str) -> bytes:
    """One SSE event carrying a JSON payload."""
    return b"data: " + payload.encode() + b"\n\n"


def sse_error_frame(error: APIError) -> bytes:
    return sse_frame(error.body().model_dump_json())


class ClientDisconnected(Exception):
    """The client closed the connection before its answer was complete."""


async def wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class _DisconnectCancels:
    """Within it, the client's disconnect cancels the current task (watched on ``receive`` by a
    task of its own); ``gone`` tells that cancellation from any other. The work runs in the
    request's own task, not a new one, so it starts in the event-loop pass that parsed the request
    (a new task would start only in the next pass, after every other request parsed in this one)."""

    def __init__(self, receive: Receive) -> None:
        self.receive = receive
        self.gone = False
        self._done = False

    def __enter__(self) -> _DisconnectCancels:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._watcher = asyncio.ensure_future(wait_for_disconnect(self.receive))
        self._watcher.add_done_callback(self._on_disconnect)
        return self

    def _on_disconnect(self, watcher: asyncio.Future[None]) -> None:
        if not watcher.cancelled() and watcher.exception() is None and not self._done:
            self.gone = True
            self._task.cancel()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: object) -> bool:
        self._done = True
        self._watcher.cancel()
        if kind is not None and issubclass(kind, asyncio.CancelledError) and self.gone:
            self._task.uncancel()  # ours: the client left
            return True
        return False


async def run_or_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client disconnects first; then cancel it and raise ClientDisconnected."""
    with _DisconnectCancels(receive):
        return await work
    raise ClientDisconnected()


@dataclass(frozen=True)
class KeepAlive:
    """What a stream sends while it has had nothing to send for ``interval_s`` (``SSEResponse``'s
    ``keepalive``): ``frame`` (Anthropic's ``ping`` event on the Messages API), so that a proxy or
    client idle timeout does not cut a request that waits in the queue, or a long prefill.
    ``error_frame``: the frame that ends the stream when the frames raise an ``APIError`` (an
    admission refusal) after a keep-alive already sent the status line."""

    interval_s: float
    frame: bytes
    error_frame: Callable[[APIError], bytes]


class SSEResponse(StreamingResponse):
    """A text/event-stream response of ``frames`` (already SSE-framed bytes).

    Unlike Starlette's StreamingResponse, the disconnect watch does not depend on the ASGI
    server's spec version, and the iterator is closed in its own task so its cleanup (the engine
    abort) has run when the response returns.

    ``hold_start``: send the status line and headers with the first frame, not before it. A
    generation stream's first frame comes with the engine's first output, and its iterator submits
    the request when first advanced: held, a burst's requests all reach the engine before any of
    them writes to its socket, so the engine's first step is not kept waiting on those writes
    (the idle engine gathers a burst before it steps, ``AsyncEngine._gather_burst``). An
    ``APIError`` the frames raise before their first (an admission refused by the engine process:
    ``refused_before_start``) is then the response, with its own status, as if the handler had
    raised it; ``error_response`` renders it (OpenAI's error shape unless told: Anthropic's for
    ``/v1/messages``).

    ``keepalive``: send ``KeepAlive.frame`` whenever the stream has sent nothing for its interval,
    also before the first frame (the status line then goes with it: a refusal after that is an
    error frame, ``KeepAlive.error_frame``). A watchdog task sends it, never during a frame's write.
    """

    def __init__(
        self,
        frames: AsyncIterator[bytes],
        headers: dict[str, str] | None = None,
        on_close: Callable[[], None] | None = None,
        hold_start: bool = False,
        error_response: Callable[[APIError], Response] = APIError.to_response,
        keepalive: KeepAlive | None = None,
    ) -> None:
        if headers:
            merged = {"cache-control": "no-cache", "x-accel-buffering": "no", **headers}
            super().__init__(frames, media_type="text/event-stream", headers=merged)
        else:
            # What Starlette's __init__ makes of the two headers above, without its per-call header
            # building (every streamed generation request constructs one of these)
            self.body_iterator = frames
            self.status_code = 200
            self.media_type = "text/event-stream"
            self.background = None
            self.raw_headers = list(SSE_HEADERS)
        self.frames = frames
        self.on_close = on_close
        self.hold_start = hold_start
        self.error_response = error_response
        self.keepalive = keepalive

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The frames run in this task (see _DisconnectCancels): the iterator's first step, which
        # submits the request to the engine, follows the handler in the same event-loop pass, so
        # a burst's requests reach the engine one by one as each is parsed. A disconnect cancels
        # the frames; the iterator's cleanup (the engine abort) has run when this returns.
        try:
            with _DisconnectCancels(receive):
                if self.keepalive is None:
                    await self._pump(send, self.raw_headers)
                else:
                    await _KeptAlive(self, send, self.keepalive).pump()
        except OSError:
            pass  # the client's socket failed under a write
        finally:
            if self.on_close is not None:
                self.on_close()

    async def _pump(self, send: Send, headers: list[tuple[bytes, bytes]]) -> None:
        start = {"type": "http.response.start", "status": 200, "headers": headers}
        held = self.hold_start
        if not held:
            await send(start)
        try:
            async for frame in self.frames:
                if held:
                    held = False
                    await send(start)
                final = type(frame) is FinalFrames
                await send({"type": "http.response.body", "body": frame, "more_body": not final})
                if final:
                    return
        except APIError as e:
            if not held:
                raise
            answer = self.error_response(e)
            await send(
                {"type": "http.response.start", "status": answer.status_code, "headers": answer.raw_headers}
            )
            await send({"type": "http.response.body", "body": answer.body, "more_body": False})
            return
        finally:
            # Close the iterator here, in this task, so its finally blocks run before we return.
            aclose = getattr(self.frames, "aclose", None)
            if aclose is not None:
                await aclose()
        if held:  # not one frame
            await send(start)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class _KeptAlive:
    """``SSEResponse._pump`` with keep-alive frames (``KeepAlive``): every write, the frames' and
    the watchdog's, goes through ``_emit``, one at a time, and the status line goes with the first."""

    def __init__(self, response: SSEResponse, send: Send, keepalive: KeepAlive) -> None:
        self.response = response
        self.send = send
        self.keepalive = keepalive
        self.start = {"type": "http.response.start", "status": 200, "headers": response.raw_headers}
        self.started = False
        self.lock = asyncio.Lock()
        self.loop = asyncio.get_running_loop()
        self.last = self.loop.time()  # when something was last written (or the stream began)

    async def _emit(self, body: bytes, more: bool) -> None:
        async with self.lock:
            if not self.started:
                self.started = True
                await self.send(self.start)
            await self.send({"type": "http.response.body", "body": body, "more_body": more})
            self.last = self.loop.time()

    async def _watch(self) -> None:
        interval = self.keepalive.interval_s
        try:
            while True:
                await asyncio.sleep(max(0.0, self.last + interval - self.loop.time()))
                if self.loop.time() - self.last >= interval and not self.lock.locked():
                    await self._emit(self.keepalive.frame, True)
        except Exception:  # noqa: BLE001 - the client's socket failed: the frames' own write says so
            logger.debug("a keep-alive write failed", exc_info=True)

    async def pump(self) -> None:
        response = self.response
        if not response.hold_start:
            self.started = True
            await self.send(self.start)
        watchdog = asyncio.ensure_future(self._watch())
        try:
            try:
                async for frame in response.frames:
                    final = type(frame) is FinalFrames
                    if final:
                        watchdog.cancel()
                    await self._emit(frame, not final)
                    if final:
                        return
            except APIError as e:
                watchdog.cancel()
                if self.started:  # a keep-alive sent the status line: the refusal is the last frame
                    await self._emit(self.keepalive.error_frame(e), False)
                    return
                answer = response.error_response(e)
                start = {
                    "type": "http.response.start",
                    "status": answer.status_code,
                    "headers": answer.raw_headers,
                }
                await self.send(start)
                await self.send({"type": "http.response.body", "body": answer.body, "more_body": False})
                return
            finally:
                aclose = getattr(response.frames, "aclose", None)
                if aclose is not None:
                    await aclose()
            watchdog.cancel()
            await self._emit(b"", False)
        finally:
            watchdog.cancel()
