"""A lean HTTP/1.1 client for the relay's hot path: keep-alive connection pools, streamed bodies.

Why not httpx here: measured on this project's machines, httpx/httpcore (anyio layers, a pool
that scans every connection per request) cost ~2 ms of CPU per proxied request, several times
what the whole replica-side stack costs. A proxy forwards one request shape to a handful of
known origins, so a small client on ``asyncio`` streams does: one write per request, the
response head parsed with ``bytes`` operations (interim 1xx heads read and dropped), bodies by
``Content-Length``, chunked encoding or connection close. Health probes and ``/v1/models`` use it
too (with short timeouts), so the router does not even import httpx.

Failure classes the relay acts on: ``ConnectError`` (nothing listens: safe to retry anywhere),
``UpstreamTimeout`` and ``UpstreamBroken`` (the connection failed after the request was sent).
A pooled connection that turns out to be stale (the server closed it while idle) before any
response byte arrives is retried once on a fresh connection, as browsers and httpcore do; a
request that must not be sent twice (``fresh``: a replica that read it and closed may have acted
on it) goes on a fresh connection from the start instead.
Cancelling a request closes its connection, so the replica sees the client go away. The pool of
idle connections per origin is ``router/upstream_pool.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import sys
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar
from urllib.parse import urlsplit, urlunsplit

from router.upstream_pool import _Conn, _Origin

T = TypeVar("T")


if sys.version_info >= (3, 11):

    async def _within(aw: Awaitable[T], seconds: float) -> T:
        async with asyncio.timeout(seconds):  # no extra task per read, unlike wait_for
            return await aw

else:  # pragma: no cover - Python 3.10
    _within = asyncio.wait_for


class UpstreamError(Exception):
    pass


class ConnectError(UpstreamError):
    pass


class UpstreamTimeout(UpstreamError):
    pass


class UpstreamBroken(UpstreamError):
    pass


class _Stale(Exception):
    """A reused connection died before the response started: retry on a fresh one."""


class Headers:
    """Response headers: raw (name, value) pairs with lower-case names, and ``get``."""

    __slots__ = ("raw",)

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self.raw = raw

    def get(self, name: str, default: str | None = None) -> str | None:
        key = name.encode()
        for k, v in self.raw:
            if k == key:
                return v.decode("latin-1")
        return default


class Response:
    """A response whose head has arrived; the body is read with ``aiter_raw``/``aread``."""

    def __init__(
        self,
        origin: _Origin,
        conn: _Conn,
        status: int,
        headers: Headers,
        read_timeout: float,
        head_request: bool = False,
    ) -> None:
        self._origin = origin
        self._conn: _Conn | None = conn
        self.status_code = status
        self.headers = headers
        self._timeout = read_timeout
        # The answer to a HEAD, a 204 and a 304 end with their head, whatever Content-Length or
        # Transfer-Encoding say (RFC 9112 §6.3): a HEAD's carries the length its GET would have.
        bodiless = head_request or status in (204, 304)
        te = headers.get("transfer-encoding")
        self._chunked = not bodiless and te is not None and "chunked" in te.lower()
        length = headers.get("content-length")
        if bodiless:
            self._remaining: int | None = 0
        else:
            self._remaining = int(length) if length is not None and not self._chunked else None
        # The body's length when its Content-Length frames it: a relay that passes it on sends the
        # body as it came, not re-framed as chunks (which an HTTP/1.0 client cannot read).
        self.content_length = None if bodiless else self._remaining
        self._keep_alive = (headers.get("connection") or "").lower() != "close" and (
            self._chunked or self._remaining is not None
        )
        self._complete = self._remaining == 0
        self._aborted = False

    def local_location(self, value: bytes) -> bytes:
        """A ``Location`` of this answer, as the router relays it: one that names the replica itself
        (which builds it from the Host the router sent, e.g. FastAPI's trailing-slash redirect)
        becomes a path, which the client follows through the router (nginx's ``proxy_redirect
        default``) rather than to an address it may not reach, past the router's checks."""
        try:
            parts = urlsplit(value.decode("latin-1"))
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:  # not a URL the replica could have meant: as it is
            return value
        origin = self._origin
        if parts.scheme in ("http", "https") and parts.hostname == origin.host and port == origin.port:
            return urlunsplit(("", "", parts.path or "/", parts.query, parts.fragment)).encode("latin-1")
        return value

    def abort(self) -> None:
        """Drop the connection now (its replica stopped answering): a read in progress, or the next,
        fails with UpstreamBroken."""
        self._aborted = True
        conn = self._conn
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.writer.transport.abort()

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        conn = self._conn
        if conn is None:
            return
        try:
            if self._chunked:
                async for data in self._dechunk(conn.reader):
                    yield data
            elif self._remaining is not None:
                while self._remaining > 0:
                    data = await _within(conn.reader.read(min(self._remaining, 1 << 16)), self._timeout)
                    if not data:
                        raise UpstreamBroken("connection closed before the end of the body")
                    self._remaining -= len(data)
                    yield data
                self._complete = True
            else:
                while True:
                    data = await _within(conn.reader.read(1 << 16), self._timeout)
                    if not data:
                        if self._aborted:
                            raise UpstreamBroken("connection to the replica dropped: it stopped answering")
                        self._complete = True
                        return
                    yield data
        except asyncio.TimeoutError as e:
            raise UpstreamTimeout("no data from the replica within the read timeout") from e
        except (
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            ConnectionError,
            OSError,
            ValueError,
        ) as e:
            raise UpstreamBroken(f"connection to the replica broke: {type(e).__name__}") from e

    async def _dechunk(self, reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
        """Chunked transfer decoding over whatever the socket delivers: one await per network read,
        every complete chunk in it handed on at once (an SSE stream is usually one event a chunk)."""
        buf = b""
        pos = 0
        while True:
            out = []
            while True:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    break
                size = int(buf[pos:eol].split(b";", 1)[0], 16)
                if size == 0:
                    if buf.find(b"\r\n", eol + 2) < 0:  # the (empty) trailer line has not arrived yet
                        break
                    if out:
                        yield b"".join(out)
                    self._complete = True
                    return
                end = eol + 2 + size
                if len(buf) < end + 2:
                    break
                out.append(buf[eol + 2 : end])
                pos = end + 2
            if out:
                yield out[0] if len(out) == 1 else b"".join(out)
            buf = buf[pos:]
            pos = 0
            data = await _within(reader.read(1 << 16), self._timeout)
            if not data:
                raise UpstreamBroken("connection closed in the middle of a chunked body")
            buf += data

    async def aread(self) -> bytes:
        parts = [chunk async for chunk in self.aiter_raw()]
        return b"".join(parts)

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._complete and self._keep_alive and conn.usable():
            self._origin.put(conn)
        else:
            conn.close()


class UpstreamClient:
    def __init__(
        self,
        connect_timeout: float = 2.0,
        read_timeout: float = 600.0,
        max_idle_per_origin: int = 512,
        ca_certs: str | None = None,
    ):
        """``ca_certs``: the CA file https replicas' certificates are checked against (default: the
        system's trusted CAs)."""
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_idle = max_idle_per_origin
        self.ca_certs = ca_certs
        self._tls: ssl.SSLContext | None = None  # made on the first https origin
        self._origins: dict[str, _Origin] = {}

    def _origin(self, base_url: str) -> _Origin:
        origin = self._origins.get(base_url)
        if origin is None:
            parts = urlsplit(base_url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ConnectError(f"unsupported replica URL {base_url!r} (http(s)://host:port expected)")
            tls = None
            if parts.scheme == "https":
                if self._tls is None:
                    self._tls = ssl.create_default_context(cafile=self.ca_certs)
                tls = self._tls
            origin = _Origin(parts.hostname, parts.port or (443 if tls else 80), self.max_idle, tls)
            self._origins[base_url] = origin
        return origin

    async def request(
        self,
        method: str,
        base_url: str,
        target: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        waiting: set[_Conn] | None = None,
        fresh: bool = False,
    ) -> Response:
        """Send a request and wait for the response head. ``target`` is the path plus query.
        ``waiting`` holds the connection while its head is awaited, for ``cut_waiting``;
        ``fresh``: on a new connection (never sent twice, module docstring)."""
        origin = self._origin(base_url)
        head = [f"{method} {target} HTTP/1.1\r\n".encode(), b"host: ", origin.host_header, b"\r\n"]
        for k, v in headers:
            head += (k, b": ", v, b"\r\n")
        head.append(b"content-length: %d\r\n\r\n" % len(body))
        payload = b"".join(head) + body
        head_request = method == "HEAD"
        conn = None if fresh else origin.take()
        if conn is not None:
            try:
                return await self._exchange(origin, conn, payload, waiting, head_request)
            except _Stale:
                pass  # the server closed it while idle; a fresh connection below
        conn = await self._connect(origin)
        try:
            return await self._exchange(origin, conn, payload, waiting, head_request)
        except _Stale as e:
            raise UpstreamBroken("the replica closed the connection without answering") from e

    async def _connect(self, origin: _Origin) -> _Conn:
        try:
            reader, writer = await _within(
                asyncio.open_connection(
                    origin.host,
                    origin.port,
                    limit=1 << 20,
                    ssl=origin.tls,
                    server_hostname=origin.host if origin.tls else None,
                ),
                self.connect_timeout,
            )
        except asyncio.TimeoutError as e:
            raise ConnectError(f"connect to {origin.host}:{origin.port} timed out") from e
        except ssl.SSLError as e:  # a certificate the CAs do not vouch for; no request byte was sent
            raise ConnectError(
                f"TLS handshake with {origin.host}:{origin.port} failed: {e.reason or e}"
            ) from e
        except OSError as e:
            raise ConnectError(f"connect to {origin.host}:{origin.port} failed: {e.strerror or e}") from e
        return _Conn(reader, writer)

    async def _exchange(
        self,
        origin: _Origin,
        conn: _Conn,
        payload: bytes,
        waiting: set[_Conn] | None = None,
        head_request: bool = False,
    ) -> Response:
        interim = False  # a 1xx head came: the replica has the request, the connection is not stale
        if waiting is not None:
            waiting.add(conn)
        try:
            conn.writer.write(payload)
            while True:
                raw = await _within(conn.reader.readuntil(b"\r\n\r\n"), self.read_timeout)
                status, headers = _parse_head(raw)
                if not 100 <= status < 200:
                    break
                if status == 101:  # never asked for (no Upgrade is sent): what follows is not HTTP/1.1
                    raise UpstreamBroken("the replica switched protocols unasked (101)")
                # An interim answer (100 Continue, 103 Early Hints…): the final one follows on the
                # same connection (RFC 9110 §15.2).
                interim = True
        except asyncio.TimeoutError as e:
            conn.close()
            raise UpstreamTimeout("no response from the replica within the read timeout") from e
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as e:
            conn.close()
            if conn.cut:
                raise UpstreamBroken("the replica stopped answering (cut when it was ejected)") from e
            stale = conn.reused and not interim
            if isinstance(e, asyncio.IncompleteReadError) and not e.partial and stale:
                raise _Stale() from e
            if isinstance(e, ConnectionResetError) and stale:
                raise _Stale() from e
            raise UpstreamBroken(f"connection to the replica broke: {type(e).__name__}") from e
        except asyncio.LimitOverrunError as e:
            conn.close()
            raise UpstreamBroken("response head too large") from e
        except (IndexError, ValueError) as e:
            conn.close()
            raise UpstreamBroken("malformed response head from the replica") from e
        except BaseException:
            conn.close()  # cancelled: the replica must see us go
            raise
        finally:
            if waiting is not None:
                waiting.discard(conn)
        return Response(origin, conn, status, Headers(headers), self.read_timeout, head_request)

    async def aclose(self) -> None:
        for origin in self._origins.values():
            origin.close()


def _parse_head(raw: bytes) -> tuple[int, list[tuple[bytes, bytes]]]:
    """A response head (through its blank line): status and headers with lower-case names;
    IndexError or ValueError when malformed."""
    lines = raw[:-4].split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    headers = []
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers.append((name.strip().lower(), value.strip()))
    return status, headers


async def fetch(
    client: UpstreamClient, method: str, base_url: str, target: str, headers: list[tuple[bytes, bytes]]
) -> tuple[int, bytes]:
    """Send a bodiless request and read the whole answer: (status, body)."""
    response = await client.request(method, base_url, target, headers, b"")
    try:
        return response.status_code, await response.aread()
    finally:
        await response.aclose()


async def get_json(
    client: UpstreamClient, base_url: str, target: str, headers: list[tuple[bytes, bytes]]
) -> object:
    """GET ``target`` and parse a 200 answer as JSON (ValueError otherwise)."""
    status, body = await fetch(client, "GET", base_url, target, headers)
    if status != 200:
        raise ValueError(f"{target} answered {status}")
    return json.loads(body)
