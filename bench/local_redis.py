"""A private redis-server on a free loopback port for the benchmarks (no data on disk), stopped
with ``stop()``; the tests have their own fixture (``tests/conftest.py``). ``LatencyProxy`` puts a
slow or stalled network path in front of it (benchmarks and tests)."""

from __future__ import annotations

import queue
import shutil
import socket
import subprocess
import tempfile
import threading
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisProcess:
    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server is not installed (Debian: apt-get install redis-server)")
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="kvbench-redis-")
        self.proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir,
                "--maxmemory",
                "4gb",
                "--maxmemory-policy",
                "allkeys-lru",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise SystemExit("redis-server did not start") from None
                time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class LatencyProxy:
    """A TCP proxy to a local port: client bytes go through at once, each reply chunk
    ``latency`` seconds after it arrived (replies in flight overlap, as on a long network path),
    and only while ``flowing`` is set (clear it to hold every reply back: a stalled server)."""

    def __init__(self, upstream_port: int, latency: float = 0.0) -> None:
        self.upstream = upstream_port
        self.latency = latency
        self.flowing = threading.Event()
        self.flowing.set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._socks: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream))
            self._socks += [client, server]
            threading.Thread(target=self._forward, args=(client, server), daemon=True).start()
            delayed: queue.SimpleQueue[tuple[float, bytes] | None] = queue.SimpleQueue()
            threading.Thread(target=self._read, args=(server, delayed), daemon=True).start()
            threading.Thread(target=self._deliver, args=(delayed, client), daemon=True).start()

    @staticmethod
    def _forward(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass

    @staticmethod
    def _read(src: socket.socket, out: queue.SimpleQueue) -> None:
        try:
            while data := src.recv(65536):
                out.put((time.monotonic(), data))
        except OSError:
            pass
        out.put(None)

    def _deliver(self, q: queue.SimpleQueue, dst: socket.socket) -> None:
        try:
            while (item := q.get()) is not None:
                arrived, data = item
                time.sleep(max(0.0, arrived + self.latency - time.monotonic()))
                self.flowing.wait()
                dst.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self.flowing.set()
        for s in self._socks:
            s.close()
