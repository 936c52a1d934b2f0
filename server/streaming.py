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
    """

    def __init__(
        self,
        frames: AsyncIterator[bytes],
        headers: dict[str, str] | None = None,
        on_close: Callable[[], None] | None = None,
        hold_start: bool = False,
        error_response: Callable[[APIError], Response] = APIError.to_response,
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

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The frames run in this task (see _DisconnectCancels): the iterator's first step, which
        # submits the request to the engine, follows the handler in the same event-loop pass, so
        # a burst's requests reach the engine one by one as each is parsed. A disconnect cancels
        # the frames; the iterator's cleanup (the engine abort) has run when this returns.
        try:
            with _DisconnectCancels(receive):
                await self._pump(send, self.raw_headers)
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
            await send({"type": "http.response.start", "status": e.status, "headers": answer.raw_headers})
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
