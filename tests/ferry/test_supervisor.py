"""The supervisor's life cycle on small real processes (a stdlib HTTP server answering /health):
crash-loop back-off, SIGKILL after the drain timeout, a second signal skipping the drain.

Workers and router here are stand-ins so each scenario runs in seconds; tests/ferry/test_up.py runs
the same supervisor over real `ferry serve` / `ferry router` processes."""

from __future__ import annotations

import io
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import alive, free_port, wait_gone

from ferry.cluster import supervisor as sup
from ferry.cluster.child import LogSink
from ferry.cluster.plan import ClusterPlan, ProcessSpec
from ferry.cluster.spec import ClusterConfig, KVTierSpec, PoolSpec, RestartSpec

# /health answers 200; with IGNORE_TERM it shrugs SIGTERM off; with LIFETIME it exits 3 after that.
STAND_IN = """
import http.server, os, signal, sys, threading
if os.environ.get("IGNORE_TERM"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("content-length", "0")
        self.end_headers()
    def log_message(self, *a):
        pass
server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H)
print("listening", flush=True)
if os.environ.get("LIFETIME"):
    threading.Timer(float(os.environ["LIFETIME"]), lambda: os._exit(3)).start()
server.serve_forever()
"""


def stand_in(name: str, kind: str, env: dict[str, str] | None = None) -> ProcessSpec:
    port = free_port()
    return ProcessSpec(name, kind, (sys.executable, "-c", STAND_IN, str(port)), port, env or {})


def run_supervisor(
    config: ClusterConfig, plan: ClusterPlan, tmp_path: Path, act
) -> tuple[int, str, dict[str, list[int]]]:
    """Run the supervisor on this (main) thread; ``act(output, pids)`` runs on another once ready."""
    out = io.StringIO()
    state = tmp_path / "state.json"
    supervisor = sup.Supervisor(config, plan, LogSink(out), state)
    pids: dict[str, list[int]] = {}

    def driver() -> None:
        deadline = time.monotonic() + 30
        while "[up] ready:" not in out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.05)
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


def test_crash_loop_backs_off_exponentially(tmp_path: Path) -> None:
    worker = stand_in("mixed-0", "worker", {"LIFETIME": "1.5"})
    router = stand_in("router", "router")
    plan = ClusterPlan("memory://", None, (worker,), router, router.url)
    config = config_for(restart=RestartSpec(initial_delay=0.2, max_delay=0.5, reset_after=60))

    def act(out: io.StringIO, supervisor: sup.Supervisor) -> None:
        wait_output(out, r"restarting in 0\.5 s", 20)
        os.kill(os.getpid(), signal.SIGTERM)

    code, output, pids = run_supervisor(config, plan, tmp_path, act)
    assert code == 0
    delays = re.findall(
        r"^\[up\] mixed-0 \(pid \d+\) exited with exit code 3; restarting in ([\d.]+) s$", output, re.M
    )
    assert delays == ["0.2", "0.4", "0.5"]  # doubled, then capped at max_delay
    assert len(pids["mixed-0"]) >= 3 and len(set(pids["mixed-0"])) == len(pids["mixed-0"])
    assert re.search(r"^\[mixed-0\] listening$", output, re.M)  # children's lines, prefixed
    assert wait_gone([p for ps in pids.values() for p in ps], 5) == []


@pytest.mark.parametrize("second_signal", [False, True])
def test_stop_kills_what_ignores_sigterm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, second_signal: bool
) -> None:
    monkeypatch.setattr(sup, "KILL_GRACE", 0.5)
    worker = stand_in("mixed-0", "worker", {"IGNORE_TERM": "1"})
    router = stand_in("router", "router")
    plan = ClusterPlan("memory://", None, (worker,), router, router.url)
    # With a second signal the drain (60 s here) is skipped; without, it lasts drain_timeout + grace.
    config = config_for(drain_timeout=60.0 if second_signal else 0.5)
    stopped_at: list[float] = []

    def act(out: io.StringIO, supervisor: sup.Supervisor) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        if second_signal:
            wait_output(out, r"^\[up\] stopping router and workers", 5)
            os.kill(os.getpid(), signal.SIGINT)
        stopped_at.append(time.monotonic())

    started = time.monotonic()
    code, output, pids = run_supervisor(config, plan, tmp_path, act)
    assert code == 0
    assert "[up] SIGTERM: draining (a second signal stops at once)" in output
    assert re.search(r"^\[up\] mixed-0 \(pid \d+\) did not stop: SIGKILL$", output, re.M)
    assert not re.search(r"^\[up\] router .*did not stop", output, re.M)  # it obeyed SIGTERM
    assert time.monotonic() - started < 20  # far below the 60 s drain when a second signal came
    assert all(not alive(p) for ps in pids.values() for p in ps)
    assert not (tmp_path / "state.json").exists()
