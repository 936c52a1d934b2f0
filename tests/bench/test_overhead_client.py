"""bench/server_overhead.py's HTTP client stamps a token when its bytes arrived, not when the
client got round to parsing them: a real loopback server writes an SSE body in two parts, and the
client parses late on purpose."""

from __future__ import annotations

import asyncio
import time

from bench.server_overhead import _Connections, _sse_events


def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


async def test_events_carry_when_their_bytes_arrived() -> None:
    sent: dict[str, float] = {}
    go_on = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (await reader.readline()) not in (b"\r\n", b""):
            pass  # the request's head (it has no body here)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + _chunk(b"data: one\n\n"))
        await writer.drain()
        sent["first"] = time.perf_counter()
        await go_on.wait()
        sent["second_before"] = time.perf_counter()
        writer.write(_chunk(b"data: two\n\ndata: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()
        sent["second"] = time.perf_counter()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        connections = _Connections("127.0.0.1", port)
        conn = await connections.post_sse(b"")
        events = _sse_events(conn[0])
        payload, first = await events.__anext__()
        assert payload == b"one" and first <= time.perf_counter()
        go_on.set()
        await asyncio.sleep(0.2)  # the second part arrives while this client is busy elsewhere
        parsed_late = time.perf_counter()
        rest = [item async for item in events]
        assert [p for p, _ in rest] == [b"two", b"[DONE]"]
        second = rest[0][1]
        assert rest[1][1] == second  # one write, one arrival
        assert sent["second_before"] <= second < parsed_late - 0.1  # stamped on arrival, not parse
        assert first < sent["second_before"]
        connections.release(conn, complete=True)
        assert connections.idle == [conn]  # the body was read to its end: reusable
        conn[1].close()
    finally:
        server.close()
        await server.wait_closed()
