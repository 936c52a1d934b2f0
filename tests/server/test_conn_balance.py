"""ConnectionBalancer and PassedConnections over real sockets: a listening TCP socket, connections
from real clients, each passed (SCM_RIGHTS) to the endpoint with the fewest open and served there
by that endpoint's protocol."""

from __future__ import annotations

import asyncio
import socket
import ssl
import time

from server.conn_balance import ConnectionBalancer, PassedConnections
from tests.server.conftest import self_signed_certificate


class _Tagged(asyncio.Protocol):
    """Answers each line with the serving endpoint's index."""

    def __init__(self, index: int) -> None:
        self.index = index

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(f"{self.index}\n".encode())


class _Replica:
    """A balancer over ``count`` endpoints, each a PassedConnections serving ``_Tagged``."""

    def __init__(self, count: int) -> None:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        self.port = listener.getsockname()[1]
        self.balancer = ConnectionBalancer(listener, count)
        self.endpoints: dict[int, PassedConnections] = {}

    def attach(self, index: int, ready: bool = True) -> PassedConnections:
        channel = self.balancer.attach(index)
        endpoint = PassedConnections(channel, lambda: _Tagged(index))
        if ready:
            endpoint.ready()
        self.endpoints[index] = endpoint
        return endpoint

    async def connect(self) -> tuple[int, asyncio.StreamWriter]:
        """A new client connection; which endpoint serves it."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        writer.write(b"who\n")
        line = await asyncio.wait_for(reader.readline(), 5)
        return int(line), writer

    def close(self) -> None:
        for endpoint in self.endpoints.values():
            endpoint.close()
        self.balancer.stop()
        self.balancer.listener.close()


async def _settle(condition, what: str) -> None:
    deadline = time.monotonic() + 60  # a hang guard only
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


async def test_connections_go_to_the_endpoint_with_the_fewest_open() -> None:
    replica = _Replica(3)
    try:
        for i in range(3):
            replica.attach(i)
        replica.balancer.start()
        await _settle(lambda: all(replica.balancer._ready), "endpoints never said ready")
        clients = [await replica.connect() for _ in range(12)]
        served = [index for index, _ in clients]
        assert served == [0, 1, 2] * 4  # equal counts: in turn
        assert replica.balancer.open == [4, 4, 4]

        # Three of endpoint 0's connections close: it is told, and takes the next three.
        for _, writer in [c for c in clients if c[0] == 0][:3]:
            writer.close()
        await _settle(lambda: replica.balancer.open == [1, 4, 4], f"open {replica.balancer.open}")
        more = [await replica.connect() for _ in range(4)]
        assert [index for index, _ in more] == [0, 0, 0, 1]
        assert replica.balancer.open == [4, 5, 4]
        for _, writer in clients + more:
            writer.close()
        await _settle(lambda: replica.balancer.open == [0, 0, 0], f"open {replica.balancer.open}")
    finally:
        replica.close()


async def test_a_gone_endpoint_takes_nothing_until_its_replacement_is_ready() -> None:
    replica = _Replica(2)
    try:
        replica.attach(0)
        replica.attach(1)
        replica.balancer.start()
        await _settle(lambda: all(replica.balancer._ready), "endpoints never said ready")
        first = [await replica.connect() for _ in range(2)]
        assert [i for i, _ in first] == [0, 1]

        replica.endpoints[1].close()  # its process died: the supervisor reads EOF
        await _settle(lambda: not replica.balancer._ready[1], "the gone endpoint still counts")
        assert replica.balancer.open[1] == 0
        held = [await replica.connect() for _ in range(3)]  # (kept open: a dropped writer closes)
        assert [i for i, _ in held] == [0, 0, 0]

        replica.attach(1, ready=False)  # restarted, not serving yet
        held += [await replica.connect() for _ in range(2)]
        assert [i for i, _ in held[3:]] == [0, 0]
        replica.endpoints[1].ready()
        await _settle(lambda: replica.balancer._ready[1], "the replacement never said ready")
        # The replacement holds none, endpoint 0 six: the next six go to the replacement.
        held += [await replica.connect() for _ in range(6)]
        assert [i for i, _ in held[5:]] == [1] * 6
        assert replica.balancer.open == [6, 6]
    finally:
        replica.close()


async def test_no_ready_endpoint_closes_the_connection() -> None:
    replica = _Replica(1)
    try:
        replica.attach(0, ready=False)
        replica.balancer.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", replica.port)
        writer.write(b"who\n")
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed, not left hanging
        writer.close()
    finally:
        replica.close()


async def test_a_failed_tls_handshake_counts_as_closed(tmp_path) -> None:
    """A passed connection that never gets through its TLS handshake (a plain-text client) is
    reported closed once; a TLS client is served by the endpoint's protocol."""
    key, cert = self_signed_certificate(tmp_path)
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, key)
    replica = _Replica(1)
    try:
        replica.endpoints[0] = PassedConnections(replica.balancer.attach(0), lambda: _Tagged(0), server_tls)
        replica.endpoints[0].ready()
        replica.balancer.start()
        await _settle(lambda: replica.balancer._ready[0], "the endpoint never said ready")

        reader, writer = await asyncio.open_connection("127.0.0.1", replica.port)
        writer.write(b"who\n" * 64)  # not a TLS client hello
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed, not left hanging
        writer.close()
        await _settle(lambda: replica.balancer.open == [0], f"open {replica.balancer.open}")

        client_tls = ssl.create_default_context(cafile=str(cert))
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", replica.port, ssl=client_tls, server_hostname="127.0.0.1"
        )
        writer.write(b"who\n")
        assert await asyncio.wait_for(reader.readline(), 5) == b"0\n"
        assert replica.balancer.open == [1]
        writer.close()
        await _settle(lambda: replica.balancer.open == [0], f"open {replica.balancer.open}")
    finally:
        replica.close()
