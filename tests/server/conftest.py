"""Real `ferry serve` processes on free loopback ports, shared per test module.

Each ``ServerProcess`` is the actual CLI in a subprocess (the path a user runs), started with
the tiny checkpoints from ``tests/conftest.py``; tests talk to it over HTTP with httpx and the
official ``openai`` SDK. Fixtures stop what they start (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from engine.outputs import merge_deltas

REPO = Path(__file__).resolve().parents[2]


def self_signed_certificate(root: Path) -> tuple[Path, Path]:
    """(key, certificate) for 127.0.0.1, made by openssl under ``root``."""
    assert shutil.which("openssl"), (
        "openssl (Debian's, on every machine this runs on) makes the test certificate"
    )
    key, cert = root / "key.pem", root / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return key, cert


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model_dir: Path, args: Sequence[str] = (), log_dir: Path | None = None) -> None:
        self.port = free_port()
        self.model_dir = model_dir
        self.args = list(args)
        self.log_path = (log_dir or Path("/tmp")) / f"ferry-serve-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def model_name(self) -> str:
        return self.model_dir.name

    def start(
        self,
        timeout: float = 120.0,
        env: dict[str, str] | None = None,
        tls_cert: Path | None = None,
        uds: Path | None = None,
    ) -> ServerProcess:
        """Run it (``env``: more environment variables) until ``/health`` answers 200 (over HTTPS,
        checked against ``tls_cert``, when the server was given a certificate; on the Unix socket
        ``uds`` when it serves there)."""
        cmd = [
            sys.executable,
            "-m",
            "ferry",
            "serve",
            "--model",
            str(self.model_dir),
            "--port",
            str(self.port),
            "--num-threads",
            "1",
            *self.args,
        ]
        env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ferry serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                health = self.url.replace("http://", "https://" if tls_cert else "http://") + "/health"
                verify = ssl.create_default_context(cafile=str(tls_cert)) if tls_cert else True
                transport = httpx.HTTPTransport(uds=str(uds)) if uds else None
                with httpx.Client(verify=verify, transport=transport, timeout=1.0) as client:
                    if client.get(health).status_code == 200:
                        return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"ferry serve did not become healthy:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text()[-4000:]
        except OSError:
            return ""

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout`` (a hang guard: a loaded machine drains slowly).
        The exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        code = self.proc.returncode
        self.proc = None
        return code


@pytest.fixture(scope="session")
def server(tiny_llama: Path, serve_logs: Path) -> Iterator[ServerProcess]:
    """The default replica over tiny_llama (shared by the session), roomy enough for 64 concurrent
    streams. Tests leave it idle and serving."""
    srv = ServerProcess(tiny_llama, ["--num-kv-blocks", "1024", "--max-num-seqs", "64"], serve_logs).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess):  # noqa: ANN201 - openai.OpenAI, imported where used
    """The OpenAI SDK on the shared replica (a module that needs another client defines its own)."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def metric_value(text: str, name: str, **labels: str) -> float | None:
    """One sample's value from a Prometheus text exposition (None when absent)."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def first_events(stream, count: int) -> list:
    """The first ``count`` events of an SDK stream; then the client leaves (closes it)."""
    events = []
    for event in stream:
        events.append(event)
        if len(events) == count:
            break
    stream.close()
    return events


def wait_in_progress(client, response_id: str, timeout: float = 30.0) -> None:
    """Until a background response has its first output (its record says ``in_progress``)."""
    deadline = time.monotonic() + timeout
    while client.responses.retrieve(response_id).status != "in_progress":
        assert time.monotonic() < deadline, f"{response_id} never got to in_progress"
        time.sleep(0.01)


@pytest.fixture(scope="session")
def scrape():
    """``scrape(url, name, **labels)``: one metric's current value from a replica's /metrics."""

    def _scrape(url: str, name: str, **labels: str) -> float | None:
        return metric_value(httpx.get(url + "/metrics", timeout=10).text, name, **labels)

    return _scrape


@pytest.fixture(scope="session")
def free_tcp_port():
    """``free_tcp_port()`` -> a free loopback port."""
    return free_port


@pytest.fixture(scope="session")
def serve_app():
    """``async with serve_app(app) as url``: an ASGI app under a real uvicorn on a free loopback
    port, in the test's own event loop (so the test can read the engine's counters between
    requests)."""

    @contextlib.asynccontextmanager
    async def serve(app) -> AsyncIterator[str]:
        server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning", lifespan="off")
        )
        task = asyncio.ensure_future(server.serve())
        while not server.started:
            assert not task.done(), "uvicorn did not start"
            await asyncio.sleep(0.01)
        try:
            yield f"http://127.0.0.1:{server.config.port}"
        finally:
            server.should_exit = True
            await task

    return serve


@pytest.fixture(scope="session")
def server_process() -> type[ServerProcess]:
    """The ServerProcess class, for modules that start replicas with their own flags."""
    return ServerProcess


@pytest.fixture(scope="session")
def serve_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("serve-logs")


@pytest.fixture
def fold_deltas(monkeypatch):
    """``fold_deltas(engine, size)``: from now on (for the test) the engine's outputs of each request
    reach the server ``size`` deltas folded into one (None: the whole answer in one delta; 0: as the
    engine gives them, undoing an earlier fold), as ``merge_pending`` folds them for a consumer
    slower than the engine (a slow client's stream). The engine itself runs as ever: only how its
    outputs are batched changes."""

    originals: dict[int, Any] = {}

    def fold(engine, size: int | None = None) -> None:
        generate = originals.setdefault(id(engine), engine.generate)
        if size == 0:
            monkeypatch.setattr(engine, "generate", generate)
            return

        async def folded(*args, **kwargs):
            held, count = None, 0
            async for out in generate(*args, **kwargs):
                held, count = (out if held is None else merge_deltas(held, out)), count + 1
                if count == size:
                    yield held
                    held, count = None, 0
            if held is not None:
                yield held

        monkeypatch.setattr(engine, "generate", folded)

    return fold
