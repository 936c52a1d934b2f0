"""A private redis-server on a free loopback port for the benchmarks (no data on disk), stopped
with ``stop()``; the tests have their own fixture (``tests/conftest.py``)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
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
