"""Helpers for `ferry up` tests: run `ferry up` as a subprocess and follow its output; run the
supervisor in process over stand-in children (a stdlib HTTP server answering /health)."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import pytest

from ferry.cluster import supervisor as sup
from ferry.cluster.child import LogSink
from ferry.cluster.plan import ClusterPlan, ProcessSpec
from ferry.cluster.spec import ClusterConfig, KVTierSpec, PoolSpec

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
    """`python -m ferry up --config FILE --state-file FILE [ARGS…]`, its output collected line by line."""

    def __init__(self, config: Path, state_file: Path, args: tuple[str, ...] = ()) -> None:
        self.state_file = state_file
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ferry",
                "up",
                "--config",
                str(config),
                "--state-file",
                str(state_file),
                *args,
            ],
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
    """Start `ferry up` on a config text (and more flags); every process is stopped when the test ends."""
    started: list[UpProcess] = []

    def start(config_text: str, *args: str) -> UpProcess:
        config = tmp_path / f"cluster{len(started)}.yaml"
        config.write_text(config_text)
        up = UpProcess(config, tmp_path / f"state{len(started)}.json", args)
        started.append(up)
        return up

    yield start
    for up in started:
        up.kill()
        print(f"---- ferry up output ({up.state_file.name}) ----\n{up.output()}")  # shown when a test fails


# /health answers 200; with IGNORE_TERM it shrugs SIGTERM off; with LIFETIME it exits 3 after that,
# first printing LAST_WORDS lines (a traceback, say) and "exiting"; it listens on HOST (127.0.0.1).
# SIGTERM with DRAIN: /health answers 503 for that long, then exit (a draining worker); with
# ASK_ON_TERM=PORT: print what 127.0.0.1:PORT/health answers, then exit (a router finishing a request).
# SIGUSR1: /health answers 503 from then on (busy: draining, its engine unwell); SIGUSR2: each request
# from then on is accepted and never answered (a hung event loop). With STARTED=FILE: every start
# after the first (FILE exists then) waits START_DELAY seconds before it listens (a model loading).
STAND_IN = """
import http.server, os, signal, sys, threading, time, urllib.error, urllib.request
draining, hung = [], []
signal.signal(signal.SIGUSR1, lambda *a: draining.append(1))
signal.signal(signal.SIGUSR2, lambda *a: hung.append(1))
if os.environ.get("STARTED"):
    if os.path.exists(os.environ["STARTED"]):
        time.sleep(float(os.environ["START_DELAY"]))
    open(os.environ["STARTED"], "a").close()
if os.environ.get("IGNORE_TERM"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if os.environ.get("DRAIN"):
    def drain(*a):
        draining.append(1)
        threading.Timer(float(os.environ["DRAIN"]), lambda: os._exit(0)).start()
    signal.signal(signal.SIGTERM, drain)
if os.environ.get("ASK_ON_TERM"):
    def ask(*a):
        url = "http://127.0.0.1:" + os.environ["ASK_ON_TERM"] + "/health"
        try:
            status = urllib.request.urlopen(url, timeout=5).status
        except urllib.error.HTTPError as e:
            status = e.code
        except OSError as e:
            status = type(e).__name__
        print("worker answered", status, flush=True)
        os._exit(0)
    signal.signal(signal.SIGTERM, ask)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        while hung:
            time.sleep(60)
        self.send_response(503 if draining else 200 if self.path == "/health" else 404)
        self.send_header("content-length", "0")
        self.end_headers()
    def log_message(self, *a):
        pass
server = http.server.HTTPServer((os.environ.get("HOST", "127.0.0.1"), int(sys.argv[1])), H)
print("listening", flush=True)
def die():
    for i in range(int(os.environ.get("LAST_WORDS", "0"))):
        print("  File", i)
    print("exiting", flush=True)
    os._exit(3)
if os.environ.get("LIFETIME"):
    threading.Timer(float(os.environ["LIFETIME"]), die).start()
server.serve_forever()
"""


def stand_in(name: str, kind: str, env: dict[str, str] | None = None) -> ProcessSpec:
    port = free_port()
    return ProcessSpec(name, kind, (sys.executable, "-c", STAND_IN, str(port)), port, env or {})


class SlowTerminal(io.StringIO):
    """A terminal that takes a moment to show each line (a remote session, a busy machine)."""

    def write(self, text: str) -> int:
        time.sleep(0.001)
        return super().write(text)


def run_supervisor(
    config: ClusterConfig, plan: ClusterPlan, tmp_path: Path, act, out: io.StringIO | None = None
) -> tuple[int, str, dict[str, list[int]]]:
    """Run the supervisor on this (main) thread; ``act(output, pids)`` runs on another once ready
    (never if it does not get ready: its signals would then reach pytest)."""
    out = io.StringIO() if out is None else out
    state = tmp_path / "state.json"
    supervisor = sup.Supervisor(config, plan, LogSink(out), state)
    pids: dict[str, list[int]] = {}

    def driver() -> None:
        deadline = time.monotonic() + 120  # the children's start: slow on a loaded machine
        while "[up] ready:" not in out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.05)
        if "[up] ready:" in out.getvalue():
            act(out, supervisor)

    thread = threading.Thread(target=driver, daemon=True)
    thread.start()
    try:
        code = supervisor.run()
    finally:
        for child in supervisor.children:
            pids[child.name] = list(child.pids)
            child.signal_group(signal.SIGKILL)
    thread.join(5)
    return code, out.getvalue(), pids


def run_steps(
    config: ClusterConfig, plan: ClusterPlan, tmp_path: Path, steps
) -> tuple[str, dict[str, list[int]], dict]:
    """Run the supervisor; ``steps(out, supervisor, seen)`` once it is ready, then SIGTERM. Returns
    its output, each child's pids and what ``steps`` put in ``seen``, once it stopped cleanly."""
    seen: dict = {}

    def act(out: io.StringIO, supervisor: sup.Supervisor) -> None:
        try:
            steps(out, supervisor, seen)
        except BaseException:
            seen["error"] = traceback.format_exc()
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    code, output, pids = run_supervisor(config, plan, tmp_path, act)
    assert "error" not in seen, f"{seen.get('error')}\n{output}"
    assert code == 0
    assert wait_gone([p for ps in pids.values() for p in ps], 60) == []
    return output, pids, seen


def wait_output(out: io.StringIO, pattern: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not re.search(pattern, out.getvalue(), re.M):
        assert time.monotonic() < deadline, f"no {pattern!r} in:\n{out.getvalue()}"
        time.sleep(0.05)


def config_for(**kw) -> ClusterConfig:
    return ClusterConfig(
        kv_tier=KVTierSpec(url="memory://"),
        prefill=PoolSpec("prefill"),
        decode=PoolSpec("decode"),
        mixed=PoolSpec("mixed", replicas=1),
        **kw,
    )
