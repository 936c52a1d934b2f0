"""Helpers for router tests: real `ferry serve` replicas and `ferry router` processes on loopback.

Replicas load a tiny checkpoint (``tiny_llama`` from tests/conftest.py) and take a few seconds
to start, so test modules share them (module scope) and start several in parallel. Every
process is stopped by its fixture; logs go to the test's tmp dir for post-mortems.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """One child process serving HTTP on ``port``."""

    def __init__(self, args: list[str], port: int, log: Path) -> None:
        self.args = args
        self.port = port
        self.log = log
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Proc:
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ferry", *self.args],
                cwd=REPO,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        return self

    def wait_http(self, timeout: float = 120.0, path: str = "/health", ok: tuple[int, ...] = (200,)) -> Proc:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.args[0]} exited ({self.proc.returncode}):\n{self.log.read_text()[-3000:]}"
                )
            try:
                if httpx.get(self.url + path, timeout=1.0).status_code in ok:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.url} not ready after {timeout}s:\n{self.log.read_text()[-3000:]}")

    def freeze(self) -> None:
        """SIGSTOP: the process holds whatever it has not sent yet (``kill9`` still ends it)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGSTOP)

    def throttle(self, run_s: float = 0.01, pause_s: float = 0.04) -> Throttle:
        """Let it run only in short slices from now on (see ``Throttle``)."""
        return Throttle(self, run_s, pause_s)

    def freeze_then_kill(self, after: float = 0.5) -> threading.Timer:
        """Freeze it now and kill -9 it ``after`` seconds later (join the returned timer): killed
        mid-stream, whatever it could have sent meanwhile had it run on."""
        self.freeze()
        killer = threading.Timer(after, self.kill9)
        killer.start()
        return killer

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Throttle:
    """Runs a process in slices: ``run_s`` running, then ``pause_s`` stopped (SIGSTOP), over and
    over, until ``freeze_then_kill``. A replica throttled so cannot race ahead of a loaded test
    client: whatever the client sees, the replica was stopped within one slice of sending it, so
    freezing it at the client's first content leaves it mid-answer."""

    def __init__(self, proc: Proc, run_s: float, pause_s: float) -> None:
        self.proc = proc
        self.run_s, self.pause_s = run_s, pause_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _signal(self, sig: int) -> None:
        if self.proc.proc is not None and self.proc.proc.poll() is None:
            self.proc.proc.send_signal(sig)

    def _loop(self) -> None:
        while not self._done.is_set():
            self._signal(signal.SIGCONT)
            time.sleep(self.run_s)
            self._signal(signal.SIGSTOP)
            self._done.wait(self.pause_s)

    def freeze_then_kill(self, after: float = 0.5) -> threading.Timer:
        """End the slicing with the process stopped; kill -9 it ``after`` seconds later."""
        self._done.set()
        self._thread.join()
        return self.proc.freeze_then_kill(after)

    def __enter__(self) -> Throttle:
        return self

    def __exit__(self, *exc: object) -> None:
        """End the slicing and let the process run on (a no-op once it is killed)."""
        self._done.set()
        self._thread.join()
        self._signal(signal.SIGCONT)


def replica_args(model: Path, port: int, *extra: str) -> list[str]:
    return [
        "serve",
        "--model",
        str(model),
        "--port",
        str(port),
        "--num-threads",
        "1",
        "--deterministic",
        "--drain-timeout",
        "1",
        *extra,
    ]


class Cluster:
    """Starts replicas and routers for one test module; stops them all at the end."""

    def __init__(self, model: Path, tmp: Path) -> None:
        self.model = model
        self.tmp = tmp
        self.procs: list[Proc] = []

    def replicas(self, n: int, *extra: str, ports: list[int] | None = None) -> list[Proc]:
        out = []
        for i in range(n):
            port = ports[i] if ports else free_port()
            p = Proc(replica_args(self.model, port, *extra), port, self.tmp / f"replica-{port}.log").start()
            self.procs.append(p)
            out.append(p)
        for p in out:  # started together, loaded in parallel
            p.wait_http()
        return out

    def router(self, *args: str, wait: bool = True, all_routable: bool = False) -> Proc:
        """A router started with ``args``; ``all_routable``: returned once every replica it was given
        is routable (a round_robin router's first request then goes to the first one)."""
        port = free_port()
        p = Proc(
            ["router", "--port", str(port), "--health-interval", "0.2", *args],
            port,
            self.tmp / f"router-{port}.log",
        ).start()
        self.procs.append(p)
        if wait:
            p.wait_http(30.0, ok=(200, 503))
        if all_routable:
            assert wait_until(lambda: all(r["routable"] for r in replicas_view(p).values()))
        return p

    def close(self) -> None:
        for p in reversed(self.procs):
            p.stop()


def metric(url: str, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of a Prometheus sample (``name`` with matching labels) from ``url``/metrics."""
    text = httpx.get(url + "/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        m = re.match(r"^([^{\s]+)(\{[^}]*\})?\s+(\S+)$", line)
        if m is None or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if labels and any(got.get(k) != v for k, v in labels.items()):
            continue
        total += float(m.group(3))
    return total


def replicas_view(router: Proc) -> dict[str, dict]:
    return {r["url"]: r for r in httpx.get(router.url + "/admin/replicas", timeout=5).json()["replicas"]}


def wait_until(predicate, timeout: float = 60.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False
