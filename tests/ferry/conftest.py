"""Helpers for `ferry up` tests: run `ferry up` as a subprocess and follow its output."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait until no pid exists; returns those still there after ``timeout``."""
    deadline = time.monotonic() + timeout
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if alive(p)]
    return left


class UpProcess:
    """`python -m ferry up --config FILE --state-file FILE`, its output collected line by line."""

    def __init__(self, config: Path, state_file: Path) -> None:
        self.state_file = state_file
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ferry", "up", "--config", str(config), "--state-file", str(state_file)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # our own Ctrl-C must not reach it; the test sends its signals
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()

    def wait_for(self, pattern: str, timeout: float, start: int = 0) -> re.Match[str]:
        """The first output line from index ``start`` on that matches ``pattern``."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        i = start
        with self._cond:
            while True:
                while i < len(self.lines):
                    m = rx.search(self.lines[i])
                    if m:
                        return m
                    i += 1
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None and i >= len(self.lines):
                    raise AssertionError(f"no line matching {pattern!r}; output:\n" + self.output())
                self._cond.wait(min(left, 0.5))

    def output(self) -> str:
        with self._cond:
            return "\n".join(self.lines)

    def state(self) -> dict:
        return json.loads(self.state_file.read_text())

    def pids(self) -> dict[str, int]:
        return {p["name"]: p["pid"] for p in self.state()["processes"]}

    def started_pids(self) -> list[int]:
        """Every pid `ferry up` said it started (from its own log lines)."""
        return [int(m) for m in re.findall(r"^\[up\] started \S+ \(pid (\d+)\)", self.output(), re.M)]

    def kill(self) -> None:
        """Last-resort cleanup for a failed test: the whole group, children included."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for pid in self.started_pids():
            if alive(pid):
                os.killpg(pid, signal.SIGKILL)


@pytest.fixture
def start_up(tmp_path: Path):
    """Start `ferry up` on a config text; every process is stopped when the test ends."""
    started: list[UpProcess] = []

    def start(config_text: str) -> UpProcess:
        config = tmp_path / f"cluster{len(started)}.yaml"
        config.write_text(config_text)
        up = UpProcess(config, tmp_path / f"state{len(started)}.json")
        started.append(up)
        return up

    yield start
    for up in started:
        up.kill()
        print(f"---- ferry up output ({up.state_file.name}) ----\n{up.output()}")  # shown when a test fails
