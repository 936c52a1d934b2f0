"""The relay's HTTP/1.1 client against a real loopback socket server with awkward framing."""

from __future__ import annotations

import asyncio

import pytest
from router_harness import free_port

from router.upstream import ConnectError, UpstreamBroken, UpstreamClient


async def _serve(handler):
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(
        next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length"))
    )
    return await reader.readexactly(length)


async def test_chunked_body_split_at_every_byte_and_connection_reuse() -> None:
    events = [b"data: " + bytes([65 + i]) * (i * 7 + 1) + b"\n\n" for i in range(12)]
    wire = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"
    connections = 0

    async def handler(reader, writer):
        nonlocal connections
        connections += 1
        for _ in range(2):
            body = await _read_request(reader)
            assert body == b'{"q": 1}'
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            )
            for i in range(len(wire)):  # one byte per TCP write: every boundary case
                writer.write(wire[i : i + 1])
                await writer.drain()
        writer.close()

    server, url = await _serve(handler)
    client = UpstreamClient(read_timeout=5)
    for _ in range(2):
        resp = await client.request(
            "POST", url, "/v1/x", [(b"content-type", b"application/json")], b'{"q": 1}'
        )
        assert resp.status_code == 200 and resp.headers.get("content-type") == "text/event-stream"
        assert await resp.aread() == b"".join(events)
        await resp.aclose()
    assert connections == 1  # keep-alive: the second request reused the connection
    await client.aclose()
    server.close()


async def test_stale_pooled_connection_is_retried_on_a_fresh_one() -> None:
    served = 0

    async def handler(reader, writer):
        nonlocal served
        await _read_request(reader)
        served += 1
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()  # closes after each answer although it did not say "connection: close"

    server, url = await _serve(handler)
    client = UpstreamClient(read_timeout=5)
    for _ in range(3):
        resp = await client.request("POST", url, "/", [], b"{}")
        assert await resp.aread() == b"ok"
        await resp.aclose()
        await asyncio.sleep(0.05)
    assert served == 3
    await client.aclose()
    server.close()


async def test_connect_refused_and_broken_body() -> None:
    client = UpstreamClient(connect_timeout=1, read_timeout=5)
    with pytest.raises(ConnectError):
        await client.request("POST", f"http://127.0.0.1:{free_port()}", "/", [], b"")

    async def handler(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        writer.transport.abort()  # dies mid-body

    server, url = await _serve(handler)
    resp = await client.request("POST", url, "/", [], b"{}")
    got = []
    with pytest.raises(UpstreamBroken):
        async for chunk in resp.aiter_raw():
            got.append(chunk)
    assert got == [b"hello"]
    await resp.aclose()
    await client.aclose()
    server.close()


async def test_answers_without_a_body_end_with_their_head_and_keep_the_connection() -> None:
    """A HEAD's answer (whose Content-Length is its GET's), a 204 and a 304 have no body whatever
    their framing headers say (RFC 9112 §6.3): reading one used to wait for bytes that never come
    (the read timeout; a HEAD relayed through the router hung its client)."""
    answers = [
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 114\r\n\r\n",
        b"HTTP/1.1 204 No Content\r\n\r\n",
        b"HTTP/1.1 304 Not Modified\r\ntransfer-encoding: chunked\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
    ]
    connections = 0

    async def handler(reader, writer):
        nonlocal connections
        connections += 1
        for answer in answers:
            await _read_request(reader)
            writer.write(answer)
            await writer.drain()
        writer.close()

    server, url = await _serve(handler)
    client = UpstreamClient(read_timeout=5)
    got = []
    for method in ("HEAD", "DELETE", "GET", "GET"):
        resp = await client.request(method, url, "/", [], b"")
        got.append((resp.status_code, await resp.aread(), resp.content_length))
        await resp.aclose()
    assert got == [(200, b"", None), (204, b"", None), (304, b"", None), (200, b"ok", 2)]
    assert connections == 1  # each answer ended where it should: the connection was reused
    await client.aclose()
    server.close()


async def test_an_ipv6_replica_gets_a_bracketed_host_and_its_own_redirects_become_paths() -> None:
    """``Host: ::1:port`` was no valid Host (RFC 9112 §3.2 wants ``[::1]:port``), and a replica builds
    its redirects from it. A Location naming the replica is relayed as a path (``local_location``)."""
    hosts = []

    async def handler(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        hosts.extend(ln.split(b": ", 1)[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"host:"))
        writer.write(b"HTTP/1.1 307 Temporary Redirect\r\ncontent-length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handler, "::1", 0)
    port = server.sockets[0].getsockname()[1]
    client = UpstreamClient(read_timeout=5)
    resp = await client.request("POST", f"http://[::1]:{port}", "/v1/x/", [], b"")
    await resp.aclose()
    assert hosts == [b"[::1]:%d" % port]
    assert resp.local_location(b"http://[::1]:%d/v1/x?a=1" % port) == b"/v1/x?a=1"
    assert resp.local_location(b"http://[::1]:%d" % port) == b"/"
    for elsewhere in (b"http://[::1]:1/v1/x", b"https://example.com/v1/x", b"/v1/x", b"http://[::1"):
        assert resp.local_location(elsewhere) == elsewhere
    await client.aclose()
    server.close()


async def test_pooled_connections_their_server_closed_are_dropped_from_under_live_ones() -> None:
    # bench/chaos.py: after one API server of a replica was killed, the router kept its connections
    # in CLOSE_WAIT beneath live ones (take() only drops stale connections it meets on top).
    by_delay: dict[float, asyncio.StreamWriter] = {}

    async def handler(reader, writer):
        while True:
            try:
                delay = float(await _read_request(reader))
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            by_delay[delay] = writer
            await asyncio.sleep(delay)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()

    server, url = await _serve(handler)
    client = UpstreamClient(read_timeout=5)

    async def call(delay: float) -> None:
        resp = await client.request("POST", url, "/", [], str(delay).encode())
        assert await resp.aread() == b"ok"
        await resp.aclose()

    await asyncio.gather(call(0.05), call(0.3), call(0.6))  # pooled in that order: 0.6's on top
    pool = client._origins[url].idle
    assert len(pool) == 3
    for delay in (0.05, 0.3):  # the two beneath: their server end closes them
        by_delay[delay].close()
    await asyncio.sleep(1.1)  # their EOF arrives; the pool's once-a-second sweep is due
    await call(0.0)  # reuses the live one on top, then returns it
    assert len(pool) == 1 and pool[0].usable()
    assert sorted(by_delay) == [0.0, 0.05, 0.3, 0.6]
    await client.aclose()
    server.close()
