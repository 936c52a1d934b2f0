"""The cluster file's liveness switches, on a running supervisor (``ferry/cluster/liveness.py``):
``liveness: false`` kills nothing as hung (a hung worker, a stopped router, our own stopped
redis-server) and counts no probes; ``termination_grace_period`` is how long a hung child has
between SIGTERM and SIGKILL: one that drains and exits within it is never SIGKILLed, and 0 sends
SIGKILL alone. Stand-in workers and router (tests/ferry/conftest.py), probes every 0.1 s waiting
0.5 s where liveness is on."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import redis
from conftest import alive, config_for, run_steps, stand_in, wait_output
from test_supervisor_liveness import plan_for, wait_for

from ferry.cluster import liveness, tier_watch
from ferry.cluster import supervisor as sup
from ferry.cluster.child import Child, LogSink
from ferry.cluster.liveness import probe_health
from ferry.cluster.spec import KVTierSpec, LivenessSpec, RedisSpec, RestartSpec

PROBES = LivenessSpec(interval=0.1, timeout=0.5, failure_threshold=3)


@pytest.fixture(autouse=True)
def short_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sup, "KILL_GRACE", 0.5)  # the stop's, for stand-ins that drain on SIGTERM
    monkeypatch.setattr(tier_watch, "CHECK_INTERVAL_S", 0.1)
    monkeypatch.setattr(tier_watch, "CHECK_TIMEOUT_S", 0.5)


def process_state(pid: int) -> str:
    """The one-letter state in /proc/PID/stat (``T``: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def liveness_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("liveness-")]


def test_switched_off_liveness_never_kills_a_hung_worker_or_router(tmp_path: Path) -> None:
    config = config_for(restart=RestartSpec(initial_delay=0.5), liveness=None, drain_timeout=0.5)
    plan = plan_for(config)
    state_file = tmp_path / "state.json"

    def steps(out: io.StringIO, supervisor: sup.Supervisor, seen: dict) -> None:
        worker, router = supervisor.servers[0].pid, supervisor.servers[-1].pid
        seen["pids"] = (worker, router)
        seen["threads"] = liveness_threads()
        os.kill(worker, signal.SIGUSR2)  # accepts connections, answers nothing
        os.kill(router, signal.SIGSTOP)
        seen["worker_probe"] = probe_health("127.0.0.1", plan.workers[0].port, 0.5)
        # Twice what liveness with PROBES takes to find both hung (three probes' 0.5 s timeouts).
        time.sleep(4.0)
        seen["router_stopped"] = process_state(router)
        seen["alive"] = (alive(worker), alive(router))
        seen["state"] = json.loads(state_file.read_text())
        os.kill(router, signal.SIGCONT)  # the stop drains it as usual

    output, pids, seen = run_steps(config, plan, tmp_path, steps)
    worker, router = seen["pids"]
    assert seen["threads"] == []  # nothing probes
    assert seen["worker_probe"] == "no answer in 0.5 s"  # the worker was hung indeed
    assert seen["router_stopped"] == "T" and seen["alive"] == (True, True)
    assert "hung" not in output and "SIGKILL" not in output, output
    state = seen["state"]
    assert state["liveness"] is None
    assert [
        (p["name"], p["pids"], p["restarts"], p["unanswered_probes"], p["hung_kills"])
        for p in state["processes"]
    ] == [
        ("mixed-0", [worker], 0, None, 0),
        ("router", [router], 0, None, 0),
    ]
    assert pids == {"mixed-0": [worker], "router": [router]}


def test_switched_off_liveness_never_kills_our_own_hung_redis(tmp_path: Path) -> None:
    config = dataclasses.replace(
        config_for(liveness=None),
        kv_tier=KVTierSpec(redis=RedisSpec()),
        restart=RestartSpec(initial_delay=0.5),
    )
    plan = plan_for(config)
    state_file = tmp_path / "state.json"

    def steps(out: io.StringIO, supervisor: sup.Supervisor, seen: dict) -> None:
        child = supervisor.redis
        seen["victim"] = victim = child.pid
        os.kill(victim, signal.SIGSTOP)
        try:
            # What gets it killed with liveness on (test_supervisor_tier_hang.py), then a second more
            # of the supervisor's loop (ten of its looks).
            wait_for(
                lambda: (
                    supervisor.tier_watcher.unanswered_since(child.healthy_since) >= tier_watch.HUNG_AFTER
                ),
                60,
                f"{tier_watch.HUNG_AFTER} unanswered PINGs",
            )
            time.sleep(1.0)
            seen["stopped"] = process_state(victim)
            seen["state"] = json.loads(state_file.read_text())
        finally:
            os.kill(victim, signal.SIGCONT)
        wait_output(out, r"^\[up\] the KV tier .* answers again", 60)
        seen["pong"] = redis.Redis.from_url(plan.kv_tier_url, socket_timeout=5).ping()

    output, pids, seen = run_steps(config, plan, tmp_path, steps)
    assert seen["stopped"] == "T"
    state = seen["state"]
    assert state["kv_tier_ok"] is False and state["liveness"] is None
    redis_state = next(p for p in state["processes"] if p["name"] == "redis")
    assert (redis_state["pids"], redis_state["hung_kills"], redis_state["unanswered_probes"]) == (
        [seen["victim"]],
        0,
        None,
    )
    assert seen["pong"] is True and pids["redis"] == [seen["victim"]]
    assert "hung" not in output and "SIGKILL" not in output, output


def test_a_hung_worker_that_exits_within_its_grace_is_never_sigkilled(tmp_path: Path) -> None:
    """A grace of 30 s and a hung worker that, given SIGTERM, exits 0 after 6 s (a drain): it is never
    SIGKILLed, so no SIGKILL came in the 6 s (longer than the 5 s grace of old, and the default)."""
    grace = dataclasses.replace(PROBES, termination_grace_period=30.0)
    config = config_for(restart=RestartSpec(initial_delay=0.5), liveness=grace, drain_timeout=0.5)
    plan = plan_for(config, {"DRAIN": "6"})
    state_file = tmp_path / "state.json"

    def steps(out: io.StringIO, supervisor: sup.Supervisor, seen: dict) -> None:
        seen["victim"] = victim = supervisor.servers[0].pid
        os.kill(victim, signal.SIGUSR2)  # accepts connections, answers nothing
        wait_output(out, r"^\[up\] mixed-0 is healthy again", 60)
        seen["state"] = json.loads(state_file.read_text())

    output, pids, seen = run_steps(config, plan, tmp_path, steps)
    victim = seen["victim"]
    lines = output.splitlines()
    hung = [line for line in lines if "hung" in line]
    assert hung == [
        f"[up] mixed-0 (pid {victim}) runs but answered none of the last 3 /health probes"
        " (the last: no answer in 0.5 s): hung; SIGTERM, then SIGKILL in 30 s, to restart it"
    ], output
    exited = f"[up] mixed-0 (pid {victim}) exited with exit code 0; restarting in 0.5 s"
    assert lines.index(hung[0]) < lines.index(exited), output
    worker = next(p for p in seen["state"]["processes"] if p["name"] == "mixed-0")
    assert worker["pids"][0] == victim and (worker["restarts"], worker["hung_kills"]) == (1, 1)
    assert seen["state"]["liveness"]["termination_grace_period"] == 30.0
    # Nothing said of a SIGKILL between the kill's announcement and the exit.
    assert "SIGKILL" not in "\n".join(lines[lines.index(hung[0]) + 1 : lines.index(exited) + 1]), output


def test_a_zero_grace_sends_sigkill_alone_once(tmp_path: Path) -> None:
    """A stand-in that would die of SIGTERM (no handler) dies of SIGKILL: no SIGTERM came first."""
    spec = stand_in("mixed-0", "worker")
    child = Child(spec, LogSink(io.StringIO()))
    said: list[str] = []
    watch = liveness.Liveness(
        dataclasses.replace(PROBES, termination_grace_period=0), [child], 600.0, said.append
    )
    child.start()
    try:
        wait_for(lambda: child.probe(), 30, "listening")
        child.healthy_since = time.monotonic()
        watch.start()
        prober = watch.probers["mixed-0"]
        wait_for(lambda: prober.since(0.0)[0], 20, "a probe answered")
        os.kill(child.pid, signal.SIGUSR2)
        wait_for(lambda: len(prober.since(0.0)[1]) == 3, 20, "three unanswered probes")
        assert watch.check(time.monotonic()) is True
        assert said == [
            f"mixed-0 (pid {child.pid}) runs but answered none of the last 3 /health probes"
            " (the last: no answer in 0.5 s): hung; SIGKILL, to restart it"
        ]
        assert child.wait(10) and child.exit_code() == -signal.SIGKILL
        watch.check(time.monotonic())
        assert len(said) == 1 and watch.kills == {"mixed-0": 1}
    finally:
        watch.stop()
        child.signal_group(signal.SIGKILL)
