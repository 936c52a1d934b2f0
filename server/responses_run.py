"""``_Run``: one background response running in this process (``server/responses_background.py``):
its events so far (all of them kept for a streamed one, so that streams following it here read
them from memory), whether it has ended, its task, and the wake-up of whoever follows it.

Split from ``BackgroundResponses``, which starts, stops and cancels runs, so that what one run
holds reads on its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from server.responses_object import _Response


class _Run:
    """One background response running in this process."""

    def __init__(self, built: _Response, request_id: str) -> None:
        self.built = built
        self.request_id = request_id  # its engine requests' (Generation.abort_request)
        self.frames: list[bytes] = []  # every event so far (kept for a streamed one only)
        self.count = 0  # events so far
        self.done = False
        self.task: asyncio.Task[None] | None = None
        self.aborting: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    @property
    def id(self) -> str:
        return self.built.id

    def publish(self, frame: bytes) -> None:
        self.count += 1
        if self.built.keeps_events:
            self.frames.append(frame)
            self._wake.set()
            self._wake = asyncio.Event()

    def end(self) -> None:
        self.done = True
        self._wake.set()

    async def changed(self) -> None:
        """Until the next event or the end."""
        if not self.done:
            await self._wake.wait()

    async def follow(self, after: int) -> AsyncIterator[bytes]:
        """The events after sequence number ``after``, as they come, until the last."""
        i = after + 1
        while True:
            while i < len(self.frames):
                yield self.frames[i]
                i += 1
            if self.done:
                return
            await self.changed()
