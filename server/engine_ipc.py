"""The wire between API server processes and the engine process (``--api-server-count``).

One Unix-domain stream socket per API server, in a directory only this user can enter. Each
frame is a 4-byte big-endian length and a pickled list of messages: everything a side sends in
one event-loop pass leaves as one frame (one ``write``, one wake-up of the other side), so a
decode step's outputs for 32 streams cost one frame, not 32. Messages are tuples whose first item
names them; ``server/engine_client.py`` and ``server/engine_process.py`` list them.

pickle, because what crosses is the engine's own typed messages (``SamplingParams``,
``RequestOutput``, ``EngineStats``) between processes of one replica that trust each other; the
socket's directory (mode 0700) keeps anyone else out.
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import struct
from typing import Any

_HEADER = struct.Struct("!I")


class Channel:
    """Framed, batched messages over one asyncio stream pair."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._loop = asyncio.get_running_loop()
        self._outbox: list[Any] = []
        self.closed = False

    def send(self, message: tuple[Any, ...], now: bool = False) -> None:
        """Queue ``message``; it leaves with everything else sent in this event-loop pass, or
        ``now`` (with what was queued before it)."""
        if self.closed:
            return
        if not self._outbox and not now:
            self._loop.call_soon(self._flush)
        self._outbox.append(message)
        if now:
            self._flush()

    def _flush(self) -> None:
        messages, self._outbox = self._outbox, []
        if self.closed or not messages:
            return
        data = pickle.dumps(messages, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self._writer.writelines((_HEADER.pack(len(data)), data))
        except (ConnectionError, RuntimeError):
            self.close()

    async def receive(self) -> list[Any] | None:
        """The next frame's messages; None once the other side is gone."""
        try:
            header = await self._reader.readexactly(_HEADER.size)
            data = await self._reader.readexactly(_HEADER.unpack(header)[0])
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        return pickle.loads(data)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            with contextlib.suppress(Exception):
                self._writer.close()
