"""The keep-alive connections beneath ``router/upstream.py``'s client: one connection, the pool of
idle ones per origin (most recently used first; those their server closed dropped when met, and
swept at most once a second so none sits in CLOSE_WAIT), and cutting the connections that wait on
a replica gone silent. No HTTP here: requests, heads and bodies are the client's.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections import deque

IDLE_SWEEP_S = 1.0  # how often returning a connection to its pool drops those their server closed


class _Conn:
    __slots__ = ("reader", "writer", "reused", "cut")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.reused = False
        self.cut = False  # dropped on purpose while waiting for a head (``cut_waiting``)

    def usable(self) -> bool:
        return not self.reader.at_eof() and not self.writer.is_closing()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class _Origin:
    def __init__(self, host: str, port: int, max_idle: int, tls: ssl.SSLContext | None = None) -> None:
        self.host = host
        self.port = port
        self.tls = tls  # https: the context its certificate is checked with
        self.host_header = f"[{host}]:{port}".encode() if ":" in host else f"{host}:{port}".encode()
        self.idle: deque[_Conn] = deque()
        self.max_idle = max_idle
        self._swept = time.monotonic()

    def put(self, conn: _Conn) -> None:
        now = time.monotonic()
        if now - self._swept >= IDLE_SWEEP_S:
            self._sweep(now)
        if len(self.idle) < self.max_idle:
            conn.reused = True
            self.idle.append(conn)
        else:
            conn.close()

    def _sweep(self, now: float) -> None:
        """Close the idle connections their server closed. ``take`` drops those it meets on top,
        but ones under a live connection would sit in CLOSE_WAIT (an fd each) for as long as the
        pool stays shallower: those of a killed API server of a replica whose other API server
        lives, or of a replica's keep-alive timeout after a burst. At most once a second: a scan
        per request is what made httpcore's pool slow."""
        self._swept = now
        for _ in range(len(self.idle)):  # in place, oldest first: the order stays
            conn = self.idle.popleft()
            if conn.usable():
                self.idle.append(conn)
            else:
                conn.close()

    def take(self) -> _Conn | None:
        while self.idle:
            conn = self.idle.pop()  # most recently used: least likely to have timed out
            if conn.usable():
                return conn
            conn.close()
        return None

    def close(self) -> None:
        while self.idle:
            self.idle.pop().close()


def cut_waiting(waiting: set[_Conn]) -> None:
    """Drop every connection in ``waiting`` (requests whose replica stopped answering): each
    request fails with UpstreamBroken, which its relay retries elsewhere."""
    for conn in waiting:
        conn.cut = True
        with contextlib.suppress(Exception):
            conn.writer.transport.abort()
    waiting.clear()
