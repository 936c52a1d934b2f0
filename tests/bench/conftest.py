"""Fixtures for the bench client tests: live servers on free loopback ports, stopped by the tests.

* ``standin``: a factory for bench/standin.py processes (the instant OpenAI stand-in).
* ``ferry_serve``: one `ferry serve` of the tiny Llama for the module; ``start_ferry_serve`` for a
  test that needs its own (e.g. to kill it).
* ``bench``: runs `ferry bench` in-process with the given flags; returns (exit code, stdout + stderr).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(proc: subprocess.Popen, url: str, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"server not ready within {timeout:.0f} s:\n{log.read_text()[-3000:]}")


class Server:
    def __init__(self, argv: list[str], tmp: Path, ready_timeout: float) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"server-{self.port}.log"
        with self.log.open("wb") as f:
            self.proc = subprocess.Popen(
                [*argv, "--port", str(self.port)], cwd=REPO, stdout=f, stderr=subprocess.STDOUT
            )
        _wait_ready(self.proc, self.url, ready_timeout, self.log)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def standin(tmp_path: Path) -> Iterator[Callable[..., Server]]:
    servers: list[Server] = []

    def start(*flags: str) -> Server:
        srv = Server([sys.executable, str(REPO / "bench" / "standin.py"), *flags], tmp_path, 30)
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.kill()


def ferry_serve_argv(model_dir: Path) -> list[str]:
    flags = "--max-num-seqs 8 --num-kv-blocks 256 --num-threads 1 --log-level warning"
    return [sys.executable, "-m", "ferry", "serve", "--model", str(model_dir), *flags.split()]


@pytest.fixture(scope="module")
def ferry_serve(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(ferry_serve_argv(tiny_llama), tmp_path_factory.mktemp("serve"), 180)
    yield srv
    srv.kill()


@pytest.fixture
def start_ferry_serve(tiny_llama: Path, tmp_path: Path) -> Iterator[Callable[[], Server]]:
    servers: list[Server] = []

    def start() -> Server:
        srv = Server(ferry_serve_argv(tiny_llama), tmp_path, 180)
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.kill()


@pytest.fixture
def bench(capsys: pytest.CaptureFixture[str]) -> Callable[..., tuple[int, str]]:
    from bench.main import run_bench
    from ferry.cli import build_parser

    def run(flags: str, *extra: str) -> tuple[int, str]:
        """``flags`` is split on whitespace; ``extra`` items (paths, JSON) are passed as they are."""
        args = build_parser().parse_args(["bench", "--no-progress", *flags.split(), *extra])
        rc = run_bench(args)
        captured = capsys.readouterr()
        return rc, captured.out + captured.err

    return run
