"""``ResponseReplay.stream``: ``GET /v1/responses/{id}?stream=true[&starting_after=N]``, a streamed
background response's events again, after N and then as they come until the last: from the run
in this process's memory, or polled from the store for one running in another process or replica
(or finished), checking its record meanwhile (its process may have died: then it is failed).

``BackgroundResponses`` (``server/responses_background.py``) is built on it; split from there so
that running and cancelling read apart from following. Like that module, this one must not import
``serving_responses``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.responses import Response

from server.errors import APIError, bad_request, unavailable
from server.responses_store import RUNNING, ResponseStore, StoreUnavailable, event_frame
from server.streaming import SSEResponse

if TYPE_CHECKING:
    from server.responses_run import _Run

# How often a stream following another process's response reads its events, and its record.
FOLLOW_POLL_S = 0.1
RECORD_CHECK_S = 1.0
_FINAL_EVENTS = tuple(
    f"event: response.{status}\n".encode() for status in ("completed", "incomplete", "failed", "cancelled")
)


def error_frame(seq: int, code: str, message: str) -> bytes:
    """An ``error`` event of a stream that cannot go on."""
    return event_frame("error", seq, code=code, message=message, param=None)


def _not_created_with(rid: str, created_with: str, only: str, **error: Any) -> APIError:
    return bad_request(f"Response '{rid}' was not created with {created_with}: only {only}.", **error)


class ResponseReplay:
    """Streaming again for ``BackgroundResponses`` (whose runs, store and record reads these are)."""

    store: ResponseStore | None
    _runs: dict[str, _Run]
    _read: Callable[[str], Awaitable[dict[str, Any] | None]]

    async def stream(self, record: dict[str, Any], starting_after: int | None) -> Response:
        """``GET /v1/responses/{id}?stream=true[&starting_after=N]``: its events after N, then as
        they come until the last."""
        body = record["response"]
        rid = body["id"]
        if not record.get("stream"):
            raise _not_created_with(
                rid, "background=true and stream=true", "those can be streamed again", param="stream"
            )
        after = -1 if starting_after is None else starting_after
        run = self._runs.get(rid)
        if run is not None:
            return SSEResponse(run.follow(after))
        assert self.store is not None  # the record came from it
        finished = body.get("status") not in RUNNING
        try:
            first, frames = await self.store.read_events(rid, after)
            if first is None and finished:  # its process may still be appending its only batch
                await asyncio.sleep(FOLLOW_POLL_S)
                first, frames = await self.store.read_events(rid, after)
        except StoreUnavailable as e:
            raise unavailable(str(e)) from e
        if first is None and finished:
            raise bad_request(
                f"The events of response '{rid}' are no longer held: retrieve it without stream.",
                param="stream",
            )
        if first is not None and after + 1 < first:
            raise bad_request(
                f"Events of response '{rid}' before sequence number {first} are no longer held: "
                f"starting_after must be at least {first - 1}.",
                param="starting_after",
            )
        return SSEResponse(self._follow_store(rid, after + 1, frames, finished))

    async def _follow_store(
        self, rid: str, next_seq: int, frames: list[bytes], finished: bool
    ) -> AsyncIterator[bytes]:
        """A response running in another process (or a finished one): its events from the store,
        polled, until the last one."""
        store = self.store
        assert store is not None
        checked = quiet_since = time.monotonic()
        try:
            while True:
                for frame in frames:
                    yield frame
                    if frame.startswith(_FINAL_EVENTS):
                        return
                next_seq += len(frames)
                now = time.monotonic()
                if frames:
                    quiet_since = now
                elif finished:
                    # Its last events are on their way to the store (appended after the record),
                    # or the client has them all, or they never came (the store failed).
                    _, last = await store.read_events(rid, next_seq - 2)
                    if last and last[0].startswith(_FINAL_EVENTS):
                        return
                    if now - quiet_since >= RECORD_CHECK_S:
                        yield error_frame(next_seq, "events_not_held", "The rest of the events are not held.")
                        return
                elif now - checked >= RECORD_CHECK_S:
                    checked = now
                    current = await self._read(rid)  # its process may have died: then failed
                    finished = current is None or current["response"].get("status") not in RUNNING
                if not frames:
                    await asyncio.sleep(FOLLOW_POLL_S)
                first, frames = await store.read_events(rid, next_seq - 1)
                if first is not None and next_seq < first:
                    yield error_frame(
                        next_seq, "events_not_held", "Events were dropped before they were read."
                    )
                    return
        except StoreUnavailable as e:
            yield error_frame(next_seq, "service_unavailable", str(e))
