"""The wire between API server processes and the engine process (``--api-server-count``).

One Unix-domain stream socket per API server, in a directory only this user can enter. Each
frame is a 4-byte big-endian length and a pickled list of messages: everything a side sends in
one event-loop pass leaves as one frame (one ``write``, one wake-up of the other side), so a
decode step's outputs for 32 streams cost one frame, not 32. Messages are tuples whose first item
names them; ``server/engine_client.py`` and ``server/engine_host.py`` list them.

pickle, because what crosses is the engine's own typed messages (``SamplingParams``,
``RequestOutput``, ``EngineStats``) between processes of one replica that trust each other; the
socket's directory (mode 0700) keeps anyone else out.
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import select
import struct
from typing import Any

_HEADER = struct.Struct("!I")
_READ_SIZE = 1 << 16


class Channel:
    """Framed, batched messages over one asyncio stream pair."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._loop = asyncio.get_running_loop()
        self._outbox: list[Any] = []
        self._buffer = bytearray()  # received bytes not yet a whole frame
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

    def retract(self, message: tuple[Any, ...]) -> bool:
        """Take ``message`` (the object given to ``send``) back if it has not left yet."""
        for i, queued in enumerate(self._outbox):
            if queued is message:
                del self._outbox[i]
                return True
        return False

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
        """The messages of every whole frame that has arrived (at least one), in order; None once
        the other side is gone. One read takes in what is there: a burst's requests, written one
        frame each, cost the reader one wake-up for all that arrived together."""
        buffer = self._buffer
        while True:
            if len(buffer) >= _HEADER.size:
                end = _HEADER.size + _HEADER.unpack_from(buffer)[0]
                if len(buffer) >= end:
                    break
                need = end - len(buffer)
            else:
                need = _HEADER.size - len(buffer)
            try:
                data = await self._reader.read(max(need, _READ_SIZE))
            except ConnectionError:
                return None
            if not data:
                return None
            buffer += data
        messages: list[Any] = []
        start = 0
        with memoryview(buffer) as view:  # released before the buffer shrinks
            while len(view) - start >= _HEADER.size:
                end = start + _HEADER.size + _HEADER.unpack_from(view, start)[0]
                if end > len(view):
                    break
                messages += pickle.loads(view[start + _HEADER.size : end])
                start = end
        del buffer[:start]
        return messages

    def pending(self) -> bool:
        """Whether the other side sent bytes this side has not read yet (in this channel's buffer,
        the stream reader's, or the socket's): a reader late to read is not a silent sender."""
        if self._buffer or len(getattr(self._reader, "_buffer", b"")):
            return True
        sock = self._writer.get_extra_info("socket")
        if sock is None or self.closed:
            return False
        poller = select.poll()  # (select.select refuses descriptors past FD_SETSIZE)
        try:
            poller.register(sock.fileno(), select.POLLIN)
            return bool(poller.poll(0))
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            with contextlib.suppress(Exception):
                self._writer.close()
