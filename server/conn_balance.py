"""Spreading a replica's connections over its API server processes (``--api-server-count N``).

The supervisor accepts on the replica's one listening socket and hands each connection to the API
server holding the fewest open (ties in turn), passing the socket itself over a Unix socket pair
(``SCM_RIGHTS``); that API server serves it as if it had accepted it. The API server says when
each passed connection closes, so the counts stay exact.

Why not ``SO_REUSEPORT`` (each API server listening on the port, the kernel choosing): the kernel
picks by a hash of the connection's addresses, so a client's few keep-alive connections land
unevenly. 32 connections over 4 API servers came out 4/7/9/12 and 3/8/10/11 (traced on a 16-core
box), and a burst's intake ends when the most loaded API server has parsed its share. The
connections a router or a load balancer keeps open to a replica are that case. Envoy's
``exact_balance`` connection balancer does the same for its worker threads.

The wire, one record each way per event (``SOCK_SEQPACKET``): ``c`` with one file descriptor, a
connection (supervisor to API server); ``r``, the API server serves (after a restart, too); ``x``,
one of its passed connections closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("ferry.server")

_CONNECTION, _READY, _CLOSED = b"c", b"r", b"x"


class ConnectionBalancer:
    """The supervisor's end: accepts on ``listener`` and hands connections out (``attach`` an API
    server's channel before it starts; it takes connections once it says it serves)."""

    def __init__(self, listener: socket.socket, count: int, backlog: int = 2048) -> None:
        self.listener = listener
        self.backlog = backlog
        self._channels: list[socket.socket | None] = [None] * count
        self._ready = [False] * count
        self.open = [0] * count  # passed connections each API server holds
        self._next = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._accepting = False

    def attach(self, index: int) -> socket.socket:
        """A new channel to API server ``index`` (replacing its last one); returns the end the API
        server process takes (close this process's copy once the process started)."""
        self._detach(index)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)
        self._channels[index] = ours
        if self._loop is not None:
            self._loop.add_reader(ours, self._hear, index)
        return theirs

    def start(self) -> None:
        """Accept from now on (on the running event loop)."""
        self._loop = asyncio.get_running_loop()
        for index, channel in enumerate(self._channels):
            if channel is not None:
                self._loop.add_reader(channel, self._hear, index)
        with contextlib.suppress(OSError):  # a Unix listener listens already
            self.listener.listen(self.backlog)
        self.listener.setblocking(False)
        self._loop.add_reader(self.listener, self._accept)
        self._accepting = True

    def stop(self) -> None:
        """Stop accepting and close every channel."""
        if self._loop is not None and self._accepting:
            self._loop.remove_reader(self.listener)
            self._accepting = False
        for index in range(len(self._channels)):
            self._detach(index)

    def _detach(self, index: int) -> None:
        channel = self._channels[index]
        if channel is not None:
            if self._loop is not None:
                self._loop.remove_reader(channel)
            channel.close()
        self._channels[index] = None
        self._ready[index] = False
        self.open[index] = 0

    def _hear(self, index: int) -> None:
        channel = self._channels[index]
        while channel is not None:
            try:
                record = channel.recv(16)
            except BlockingIOError:
                return
            except OSError:
                record = b""
            if not record:  # that API server is gone: its connections went with it
                self._detach(index)
                return
            if record == _READY:
                self._ready[index] = True
            elif record == _CLOSED:
                self.open[index] = max(0, self.open[index] - 1)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of file descriptors, a connection reset while queued
                logger.warning("accept failed: %s", e)
                return
            with conn:  # the API server holds its own copy once passed
                self._hand(conn)

    def _hand(self, conn: socket.socket) -> None:
        count = len(self._channels)
        while True:
            ready = [i for i in range(count) if self._ready[i]]
            if not ready:
                logger.warning("no API server takes connections: closing one")
                return
            # The fewest open; among equals, the next in turn after the last one chosen.
            index = min(ready, key=lambda i: (self.open[i], (i - self._next) % count))
            channel = self._channels[index]
            assert channel is not None
            try:
                socket.send_fds(channel, [_CONNECTION], [conn.fileno()])
            except BlockingIOError:  # its channel is full (it stopped reading): pass it over
                self._ready[index] = False
                continue
            except OSError:
                self._detach(index)
                continue
            self.open[index] += 1
            self._next = index + 1
            return


class PassedConnections:
    """An API server's end: serves every connection the supervisor passes, with the protocol its
    uvicorn would have made for a connection it accepted itself (``protocol_factory``), and says
    when each one closes."""

    def __init__(self, channel: socket.socket, protocol_factory: Callable[[], Any], ssl: Any = None) -> None:
        self.channel = channel
        self.protocol_factory = protocol_factory
        self.ssl = ssl
        self._loop = asyncio.get_running_loop()
        channel.setblocking(False)
        self._loop.add_reader(channel, self._receive)
        self._closed = False

    def ready(self) -> None:
        """Tell the supervisor to pass connections here (once this API server serves)."""
        self._say(_READY)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._loop.remove_reader(self.channel)
            self.channel.close()

    def _say(self, record: bytes) -> None:
        if self._closed:
            return
        try:
            self.channel.send(record)
        except OSError:  # the supervisor is gone: this process follows (PR_SET_PDEATHSIG)
            pass

    def _receive(self) -> None:
        while not self._closed:
            try:
                record, fds, _, _ = socket.recv_fds(self.channel, 16, 4)
            except BlockingIOError:
                return
            except OSError:
                record, fds = b"", []
            if not record:  # the supervisor closed its end
                self.close()
                return
            for fd in fds:
                asyncio.ensure_future(self._serve(socket.socket(fileno=fd)))

    async def _serve(self, sock: socket.socket) -> None:
        def protocol() -> Any:
            proto = self.protocol_factory()
            lost = proto.connection_lost

            def connection_lost(exc: Exception | None) -> None:
                try:
                    lost(exc)
                finally:
                    self._say(_CLOSED)

            proto.connection_lost = connection_lost
            return proto

        try:
            await self._loop.connect_accepted_socket(protocol, sock, ssl=self.ssl)
        except (OSError, ConnectionError) as e:  # the client left first, a failed TLS handshake
            logger.debug("a passed connection failed before it was served: %s", e)
            sock.close()
            self._say(_CLOSED)
