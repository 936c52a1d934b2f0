"""How `ferry up` stops, on stand-in children: SIGKILL after the drain timeout, the router drained
before the workers, a second signal skipping every drain left, and signals that arrive while
ferry up prints (or SIGHUP, when its terminal closes)."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    REPO,
    STAND_IN,
    alive,
    config_for,
    free_port,
    run_supervisor,
    stand_in,
    wait_gone,
    wait_output,
)

from ferry.cluster import supervisor as sup
from ferry.cluster.plan import ClusterPlan


@pytest.mark.parametrize("second_signal", [False, True])
def test_stop_kills_what_ignores_sigterm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, second_signal: bool
) -> None:
    monkeypatch.setattr(sup, "KILL_GRACE", 0.5)
    worker = stand_in("mixed-0", "worker", {"IGNORE_TERM": "1"})
    router = stand_in("router", "router")
    plan = ClusterPlan("memory://", None, (worker,), router, router.url)
    # With a second signal the drain (10 min here) is skipped; without, it lasts drain_timeout + grace.
    config = config_for(drain_timeout=600.0 if second_signal else 0.5)
    signalled: list[float] = []

    def act(out: io.StringIO, supervisor: sup.Supervisor) -> None:
        signalled.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGTERM)
        if second_signal:
            wait_output(out, r"^\[up\] stopping workers", 60)
            os.kill(os.getpid(), signal.SIGINT)

    code, output, pids = run_supervisor(config, plan, tmp_path, act)
    assert code == 0
    assert "[up] SIGTERM: draining (a second signal stops at once)" in output
    assert re.search(r"^\[up\] mixed-0 \(pid \d+\) did not stop: SIGKILL$", output, re.M)
    assert not re.search(r"^\[up\] router .*did not stop", output, re.M)  # it obeyed SIGTERM
    # From the signal (not the children's start, slow on a loaded machine): far below the drain.
    assert time.monotonic() - signalled[0] < 120
    assert all(not alive(p) for ps in pids.values() for p in ps)
    assert not (tmp_path / "state.json").exists()


def test_the_router_drains_while_the_workers_still_serve(tmp_path: Path) -> None:
    """A draining worker refuses new work (503): stopped together, the router's in-flight requests
    that still needed a worker (a PD hand-off, a retry) failed. The router goes first."""
    worker = stand_in("mixed-0", "worker", {"DRAIN": "1"})
    router = stand_in("router", "router", {"ASK_ON_TERM": str(worker.port)})
    plan = ClusterPlan("memory://", None, (worker,), router, router.url)

    def act(out: io.StringIO, supervisor: sup.Supervisor) -> None:
        os.kill(os.getpid(), signal.SIGTERM)

    code, output, pids = run_supervisor(config_for(drain_timeout=5.0), plan, tmp_path, act)
    assert code == 0
    assert "[router] worker answered 200" in output
    up_lines = [line for line in output.splitlines() if line.startswith("[up] ")]
    assert up_lines[-4:] == [
        "[up] SIGTERM: draining (a second signal stops at once)",
        "[up] stopping the router (drain up to 5 s)",
        "[up] stopping workers (drain up to 5 s)",
        "[up] stopped",
    ]
    assert wait_gone([p for ps in pids.values() for p in ps], 60) == []


def test_a_second_signal_during_the_routers_drain_skips_the_workers_drain_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sup, "KILL_GRACE", 0.5)
    worker = stand_in("mixed-0", "worker", {"IGNORE_TERM": "1"})
    router = stand_in("router", "router", {"IGNORE_TERM": "1"})
    plan = ClusterPlan("memory://", None, (worker,), router, router.url)

    signalled: list[float] = []

    def act(out: io.StringIO, supervisor: sup.Supervisor) -> None:
        signalled.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGTERM)
        wait_output(out, r"^\[up\] stopping the router", 60)
        os.kill(os.getpid(), signal.SIGINT)

    code, output, pids = run_supervisor(config_for(drain_timeout=600.0), plan, tmp_path, act)
    assert code == 0
    assert re.findall(r"^\[up\] (\S+) \(pid \d+\) did not stop: SIGKILL$", output, re.M) == [
        "router",
        "mixed-0",
    ]
    assert time.monotonic() - signalled[0] < 120  # from the first signal: far below two 600 s drains
    assert wait_gone([p for ps in pids.values() for p in ps], 60) == []


SIGNAL_WHILE_PRINTING = """
import os, signal, sys
from pathlib import Path
from ferry.cluster import supervisor as sup
from ferry.cluster.child import LogSink
from ferry.cluster.plan import ClusterPlan, ProcessSpec
from ferry.cluster.spec import ClusterConfig, KVTierSpec, PoolSpec

class Terminal:
    # stdout, where signals arrive just as ferry up prints its ready line
    def write(self, text):
        if text.startswith("[up] ready:"):
            for name in sys.argv[4].split(","):
                os.kill(os.getpid(), signal.Signals[name])
        return sys.stdout.write(text)
    def flush(self):
        sys.stdout.flush()

if sys.argv[5] == "nohup":
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
worker_port, router_port, stand_in = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
worker = ProcessSpec("mixed-0", "worker", (sys.executable, "-c", stand_in, str(worker_port)), worker_port)
router = ProcessSpec("router", "router", (sys.executable, "-c", stand_in, str(router_port)), router_port)
config = ClusterConfig(kv_tier=KVTierSpec(url="memory://"), prefill=PoolSpec("prefill"),
                       decode=PoolSpec("decode"), mixed=PoolSpec("mixed", replicas=1), drain_timeout=5)
plan = ClusterPlan("memory://", None, (worker,), router, router.url)
sys.exit(sup.Supervisor(config, plan, LogSink(Terminal()), Path(sys.argv[6])).run())
"""


@pytest.mark.parametrize(
    ("signals", "nohup", "stopped_by"),
    [
        ("SIGTERM", "", "SIGTERM"),
        ("SIGHUP", "", "SIGHUP"),  # the terminal closed: drain and clean up, not die on the spot
        ("SIGHUP,SIGTERM", "nohup", "SIGTERM"),  # `nohup ferry up` keeps running through SIGHUP
    ],
)
def test_a_signal_while_ferry_up_prints_stops_it_cleanly(
    tmp_path: Path, signals: str, nohup: str, stopped_by: str
) -> None:
    """The signal handler runs on the main thread, which may be inside the log sink's lock: a line
    said from the handler waited for that lock forever (and Ctrl-C then stopped nothing)."""
    state = tmp_path / "state.json"
    ports = [str(free_port()), str(free_port())]
    argv = [sys.executable, "-c", SIGNAL_WHILE_PRINTING, *ports, STAND_IN, signals, nohup, str(state)]
    proc = subprocess.Popen(
        argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its children follow it (PR_SET_PDEATHSIG)
        out, _ = proc.communicate()
        raise AssertionError(f"ferry up hung after the signal; output:\n{out}") from None
    pids = [int(p) for p in re.findall(r"^\[up\] started \S+ \(pid (\d+)\)", out, re.M)]
    assert proc.returncode == 0, out
    lines = [line for line in out.splitlines() if line.startswith("[up] ")]
    assert any(line.startswith("[up] ready: http://127.0.0.1:") for line in lines)
    announced = lines.index("[up] Ctrl-C (or SIGTERM) drains and stops everything.")
    assert lines[announced + 1 :] == [
        f"[up] {stopped_by}: draining (a second signal stops at once)",
        "[up] stopping the router (drain up to 5 s)",
        "[up] stopping workers (drain up to 5 s)",
        "[up] stopped",
    ]
    assert len(pids) == 2 and wait_gone(pids, 60) == []
    assert not state.exists()
