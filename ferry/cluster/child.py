"""One supervised child process of `ferry up`: start it, prefix its log lines, probe it, stop it.

Every child runs in its own session (process group), so a terminal's Ctrl-C reaches only
`ferry up`, which then drains the children in order, and a stop can signal a child together with
anything it started. On Linux each child also asks the kernel to send it SIGTERM when `ferry up`
dies (``PR_SET_PDEATHSIG``), so even ``kill -9`` of `ferry up` leaves no orphan behind. The kernel
sends that signal when the *thread* that forked the child ends, which is why the supervisor starts
every child from the main thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

from ferry.cluster.plan import ProcessSpec

PR_SET_PDEATHSIG = 1


def parent_death_hook(parent: int | None = None) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child die (SIGTERM) with ``parent`` (default: this process)
    on Linux, or None elsewhere. A spawned child calls it itself, with its parent's pid."""
    if not sys.platform.startswith("linux"):
        return None
    # Resolved here, in the parent: the forked child should only make the system call.
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid() if parent is None else parent

    def hook() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the hook ran
            os.kill(os.getpid(), signal.SIGTERM)

    return hook


class LogSink:
    """Writes lines from many children to one stream, whole lines at a time, each with its prefix."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.lock = threading.Lock()

    def line(self, prefix: str, text: str) -> None:
        with self.lock:
            try:
                self.stream.write(f"[{prefix}] {text}\n")
                self.stream.flush()
            except (OSError, ValueError):  # stdout closed (e.g. a pipe whose reader left)
                pass


class Child:
    """A ``ProcessSpec`` and its current process, with the counters the supervisor keeps."""

    def __init__(self, spec: ProcessSpec, sink: LogSink, cwd: str | None = None) -> None:
        self.spec = spec
        self.sink = sink
        self.cwd = cwd  # None: ours
        self.proc: subprocess.Popen[bytes] | None = None
        self.pids: list[int] = []  # every pid this child has had, oldest first
        self.restarts = 0
        self.crashes = 0  # consecutive crashes: sets the back-off
        self.started_at: float | None = None  # monotonic time the current process started
        self.healthy_since: float | None = None  # monotonic time of the last healthy probe
        self.ever_healthy = False
        self.restart_at: float | None = None  # set while waiting out a back-off
        self._pump: threading.Thread | None = None
        self._death_hook = parent_death_hook()

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            self.spec.argv,
            env={**os.environ, **self.spec.env},
            cwd=self.cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=self._death_hook,
        )
        self.pids.append(self.proc.pid)
        self.started_at = time.monotonic()
        self.healthy_since = None
        self._pump = threading.Thread(
            target=self._pump_lines, args=(self.proc,), name=f"log-{self.name}", daemon=True
        )
        self._pump.start()

    def _pump_lines(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        with proc.stdout:
            for raw in iter(proc.stdout.readline, b""):
                # Progress bars redraw with \r: keep what the last redraw says.
                text = raw.decode("utf-8", "replace").rstrip("\r\n").rsplit("\r", 1)[-1]
                self.sink.line(self.name, text)

    def exit_code(self) -> int | None:
        """The exit status if the current process has ended (None while it runs)."""
        return None if self.proc is None else self.proc.poll()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def probe(self, timeout: float = 1.0) -> bool:
        """A worker's ``GET /health`` answers 200; Redis answers PING with PONG; the router answers
        HTTP at all (its /health also depends on the workers: the supervisor judges that part)."""
        if self.spec.kind == "redis":
            return _redis_ping(self.spec.host, self.spec.port, timeout)
        conn = http.client.HTTPConnection(self.spec.host, self.spec.port, timeout=timeout)
        try:
            conn.request("GET", "/health")
            status = conn.getresponse().status
            return status == 200 or self.spec.kind == "router"
        except (OSError, http.client.HTTPException):
            return False
        finally:
            conn.close()

    def signal_group(self, sig: int) -> None:
        """Signal the child's whole process group (it and anything it started)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def wait(self, timeout: float) -> bool:
        if self.proc is None:
            return True
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def join_logs(self, timeout: float) -> None:
        if self._pump is not None:
            self._pump.join(timeout)


def _redis_ping(host: str, port: int, timeout: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            deadline = time.monotonic() + timeout
            reply = b""
            while not reply.endswith(b"\r\n") and time.monotonic() < deadline:
                chunk = s.recv(64)
                if not chunk:
                    break
                reply += chunk
            return reply.startswith(b"+PONG")
    except OSError:
        return False
