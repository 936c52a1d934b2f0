"""`ferry serve --api-server-count 2` starts its API server processes while the engine process loads
the model, and they connect once it is ready (``server/api_servers.py``).

The engine is held in the middle of its load, deterministically: the model directory's
``config.json`` is a FIFO, so the engine process's first read of it waits in ``open`` until the test
writes the file (``HeldModel``). Meanwhile the test looks at the supervisor's children: with the
overlap, the API server processes exist already (and are the ones that serve afterwards); without
it, only the engine would. The start's other outcomes while they wait: the engine refusing its flags
(exit 2 with the engine's message last, no API server left, none of theirs printed), a signal,
and a killed supervisor.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.test_api_servers import API_SERVERS, _children, _gone, _is_engine, _processes


class HeldModel:
    """A model directory (links to ``source``'s files) whose ``config.json`` is a FIFO: the engine
    process loading it waits until ``release``; reads after that find a plain file."""

    def __init__(self, source: Path, root: Path) -> None:
        root.mkdir()
        for entry in source.iterdir():
            if entry.name != "config.json":
                (root / entry.name).symlink_to(entry)
        self.dir = root
        self._config = (source / "config.json").read_bytes()
        self._fifo = root / "config.json"
        os.mkfifo(self._fifo)
        self._writer: int | None = None

    def wait_for_reader(self, proc, timeout: float = 90.0) -> None:
        """Until a process waits to read the FIFO (the engine process, loading the model); fails if
        ``proc`` (the supervisor) exits first."""
        deadline = time.monotonic() + timeout
        while self._writer is None:
            assert proc.poll() is None, f"ferry serve exited with {proc.returncode}"
            assert time.monotonic() < deadline, "the engine process never read config.json"
            try:  # a FIFO opens for writing without blocking only while a reader waits
                self._writer = os.open(self._fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as e:
                assert e.errno == errno.ENXIO, e
                time.sleep(0.05)

    def release(self) -> None:
        """Give the waiting reader the real ``config.json``; later opens get a plain file."""
        assert self._writer is not None
        staged = self.dir / ".config.json"
        staged.write_bytes(self._config)
        os.replace(staged, self._fifo)  # the open FIFO lives on for its reader
        os.set_blocking(self._writer, True)
        os.write(self._writer, self._config)
        self.close()

    def close(self) -> None:
        if self._writer is not None:
            os.close(self._writer)
            self._writer = None


@pytest.fixture
def held(tiny_llama: Path, tmp_path: Path) -> Iterator[HeldModel]:
    model = HeldModel(tiny_llama, tmp_path / "held")
    yield model
    model.close()


@contextlib.contextmanager
def starting(srv) -> Iterator[list]:
    """``srv.start()`` (until healthy, or its RuntimeError) on a thread, so the test can act while it
    starts; yields the outcome list (filled once it has), and stops the replica at the end."""
    outcome: list = []

    def start() -> None:
        try:
            srv.start()
            outcome.append("healthy")
        except RuntimeError as e:
            outcome.append(e)

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while srv.proc is None and not outcome:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        yield outcome
    finally:
        if not outcome and srv.proc is not None and srv.proc.poll() is None:
            srv.proc.send_signal(signal.SIGTERM)  # a failed test: its start ends now
        thread.join(120)
        srv.stop()


def _held_children(srv) -> tuple[int, list[int]]:
    """(engine pid, API server pids) while the engine is held: the API servers are waiting too, so
    every child stays (the engine is the one that has imported torch)."""
    kinds = {pid: _is_engine(pid) for pid in _children(srv.proc.pid)}
    engines = [pid for pid, engine in kinds.items() if engine]
    assert len(engines) == 1, kinds
    return engines[0], sorted(pid for pid, engine in kinds.items() if engine is False)


def _wait_outcome(outcome: list, timeout: float = 90) -> object:
    deadline = time.monotonic() + timeout
    while not outcome:
        assert time.monotonic() < deadline, "the replica neither served nor exited"
        time.sleep(0.05)
    return outcome[0]


def test_api_servers_start_while_the_engine_loads(held, serve_logs: Path, server_process) -> None:
    srv = server_process(held.dir, API_SERVERS, serve_logs)
    with starting(srv) as outcome:
        held.wait_for_reader(srv.proc)
        # The engine is mid-load; the supervisor has started both API servers already.
        engine, api = _held_children(srv)
        assert len(api) == 2, (engine, api)
        with pytest.raises(httpx.ConnectError):  # nothing serves before the engine is ready
            httpx.get(srv.url + "/health", timeout=5)
        held.release()
        assert _wait_outcome(outcome) == "healthy", srv.log()
        # Those very processes connected to the engine and serve (none was replaced).
        assert _processes(srv) == (engine, api)
        answer = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2
        assert "did not start" not in srv.log()


def test_an_engine_start_error_leaves_no_api_server(held, serve_logs: Path, server_process) -> None:
    """The API servers started during the load never served: the engine's refusal is reported as
    with one process (exit 2, its message the last output), and they are gone, silently."""
    srv = server_process(held.dir, [*API_SERVERS, "--max-model-len", "99999"], serve_logs)
    with starting(srv) as outcome:
        held.wait_for_reader(srv.proc)
        engine, api = _held_children(srv)
        assert len(api) == 2
        held.release()
        assert isinstance(_wait_outcome(outcome), RuntimeError)
        assert srv.proc.wait(30) == 2
        assert _gone([engine, *api], 10)
        log = srv.log_path.read_text()
        assert log.strip().endswith(
            "ferry serve: error: max_model_len=99999 is more than the 1024 positions of the model "
            "(max_position_embeddings=1024)"
        ), log
        for stray in ("Traceback", "Started server process", "api-server-"):
            assert stray not in log, log


def test_a_signal_while_the_engine_loads_stops_every_process(held, serve_logs: Path, server_process) -> None:
    """SIGTERM to the supervisor during the load (SIGINT, Ctrl-C, takes the same handler): it exits
    0 and takes the waiting API servers and the engine with it."""
    srv = server_process(held.dir, API_SERVERS, serve_logs)
    with starting(srv) as outcome:
        held.wait_for_reader(srv.proc)
        engine, api = _held_children(srv)
        assert len(api) == 2
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(30) == 0, srv.log()
        assert _gone([engine, *api], 20)
        assert isinstance(_wait_outcome(outcome), RuntimeError)
        assert "Traceback" not in srv.log_path.read_text()


def test_waiting_api_servers_die_with_a_killed_supervisor(held, serve_logs: Path, server_process) -> None:
    """``kill -9`` of the supervisor during the load: the waiting API servers die with it
    (``PR_SET_PDEATHSIG``); the engine does once its load returns (the signal waits for its loop)."""
    srv = server_process(held.dir, API_SERVERS, serve_logs)
    with starting(srv) as outcome:
        held.wait_for_reader(srv.proc)
        engine, api = _held_children(srv)
        assert len(api) == 2
        srv.proc.kill()
        assert _gone(api, 20)
        held.release()
        assert _gone([engine], 60)
        assert isinstance(_wait_outcome(outcome), RuntimeError)
