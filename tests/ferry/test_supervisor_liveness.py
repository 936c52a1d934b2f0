"""Liveness probes of a running cluster's workers and router (``ferry/cluster/liveness.py``): a child
whose process runs but leaves ``failure_threshold`` probes of its ``/health`` in a row unanswered
(accepts and never answers, or SIGSTOP) is killed, said once with why, and restarted on its port; one
answering 503 (busy, draining) is not; nor is a restarted one loading (not listening yet) until
``startup_timeout``. Stand-in children (tests/ferry/conftest.py), probes every 0.1 s waiting 0.5 s."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import config_for, run_steps, stand_in, wait_output

from ferry.cluster import liveness
from ferry.cluster import supervisor as sup
from ferry.cluster.child import Child, LogSink
from ferry.cluster.config import ConfigError, parse_config
from ferry.cluster.plan import build_plan
from ferry.cluster.spec import LivenessSpec, RestartSpec
from ferry.strict_yaml import load_yaml

PROBES = LivenessSpec(interval=0.1, timeout=0.5, failure_threshold=3, termination_grace_period=1.0)


@pytest.fixture(autouse=True)
def short_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sup, "KILL_GRACE", 0.5)  # the stop's, for workers that shrug SIGTERM off


def plan_for(config, worker_env: dict[str, str] | None = None):
    return dataclasses.replace(
        build_plan(config),
        workers=(stand_in("mixed-0", "worker", worker_env),),
        router=stand_in("router", "router"),
    )


def health(port: int) -> int:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status
    except urllib.error.HTTPError as e:
        return e.code


def wait_for(done, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"never {what}"
        time.sleep(0.05)


def process(state_file: Path, name: str) -> dict:
    return next(p for p in json.loads(state_file.read_text())["processes"] if p["name"] == name)


def test_a_worker_answering_503_lives_and_one_that_never_answers_is_killed_and_restarted(
    tmp_path: Path,
) -> None:
    config = config_for(restart=RestartSpec(initial_delay=0.5), liveness=PROBES, drain_timeout=0.5)
    plan = plan_for(config, {"IGNORE_TERM": "1"})  # a hung process that shrugs SIGTERM off: SIGKILL
    port = plan.workers[0].port
    state_file = tmp_path / "state.json"

    def steps(out: io.StringIO, supervisor: sup.Supervisor, seen: dict) -> None:
        seen["victim"] = victim = supervisor.servers[0].pid
        os.kill(victim, signal.SIGUSR1)
        seen["busy"] = health(port)
        # Probes sent a whole second (ten intervals) after it turned busy get answers: its 503s.
        busy_from = time.monotonic() + 1.0
        prober = supervisor.liveness.probers["mixed-0"]
        wait_for(lambda: prober.since(busy_from)[0], 20, "a probe of the busy worker answered")
        seen["busy_state"] = process(state_file, "mixed-0")
        seen["busy_pid"] = supervisor.servers[0].pid
        os.kill(victim, signal.SIGUSR2)  # accepts connections, answers nothing
        wait_output(out, r"^\[up\] mixed-0 is healthy again", 30)
        seen["state"] = json.loads(state_file.read_text())
        seen["health"] = health(port)

    output, pids, seen = run_steps(config, plan, tmp_path, steps)
    victim = seen["victim"]
    assert seen["busy"] == 503 and seen["busy_pid"] == victim
    assert seen["busy_state"]["unanswered_probes"] == 0 and seen["busy_state"]["hung_kills"] == 0
    lines = output.splitlines()
    hung = [line for line in lines if "hung" in line]
    assert hung == [
        f"[up] mixed-0 (pid {victim}) runs but answered none of the last 3 /health probes"
        " (the last: no answer in 0.5 s): hung; SIGTERM, then SIGKILL in 1 s, to restart it"
    ], output
    exited = f"[up] mixed-0 (pid {victim}) exited with signal SIGKILL; restarting in 0.5 s"
    assert lines.index(hung[0]) < lines.index(exited)
    worker = next(p for p in seen["state"]["processes"] if p["name"] == "mixed-0")
    assert worker["pids"][0] == victim and worker["pid"] != victim and len(worker["pids"]) == 2
    assert (worker["restarts"], worker["hung_kills"], worker["unanswered_probes"]) == (1, 1, 0)
    assert f"[up] mixed-0 is healthy again (pid {worker['pid']})" in lines
    assert seen["health"] == 200
    assert seen["state"]["liveness"] == {
        "interval": 0.1,
        "timeout": 0.5,
        "failure_threshold": 3,
        "termination_grace_period": 1.0,
    }
    assert pids["router"] == [seen["state"]["processes"][-1]["pid"]]  # the router was left alone


def test_a_stopped_router_is_killed_and_restarted(tmp_path: Path) -> None:
    config = config_for(restart=RestartSpec(initial_delay=0.5), liveness=PROBES)
    plan = plan_for(config)
    state_file = tmp_path / "state.json"

    def steps(out: io.StringIO, supervisor: sup.Supervisor, seen: dict) -> None:
        seen["victim"] = victim = supervisor.servers[-1].pid
        os.kill(victim, signal.SIGSTOP)
        wait_output(out, r"^\[up\] router is healthy again", 30)
        seen["state"] = process(state_file, "router")
        seen["health"] = health(plan.router.port)

    output, pids, seen = run_steps(config, plan, tmp_path, steps)
    victim = seen["victim"]
    assert re.search(
        rf"^\[up\] router \(pid {victim}\) runs but answered none of the last 3 /health probes"
        r" \(the last: [^)]+\): hung; SIGTERM, then SIGKILL in 1 s, to restart it$",
        output,
        re.M,
    ), output
    assert f"[up] router (pid {victim}) exited with signal SIGKILL; restarting in 0.5 s" in output
    router = seen["state"]
    assert router["pid"] != victim and router["pids"] == [victim, router["pid"]] and router["hung_kills"] == 1
    assert seen["health"] == 200
    assert len(pids["mixed-0"]) == 1


def test_a_restarted_worker_is_not_judged_while_it_loads(tmp_path: Path) -> None:
    """Its port refuses connections for 3 s (about six failure thresholds of probes): not hung."""
    config = config_for(restart=RestartSpec(initial_delay=0.5), liveness=PROBES, startup_timeout=30)
    env = {"STARTED": str(tmp_path / "started"), "START_DELAY": "3"}
    plan = plan_for(config, env)

    def steps(out: io.StringIO, supervisor: sup.Supervisor, seen: dict) -> None:
        seen["victim"] = victim = supervisor.servers[0].pid
        os.kill(victim, signal.SIGKILL)
        wait_output(out, r"^\[up\] mixed-0 is healthy again", 30)
        seen["state"] = process(tmp_path / "state.json", "mixed-0")

    output, pids, seen = run_steps(config, plan, tmp_path, steps)
    assert "hung" not in output, output
    assert seen["state"]["restarts"] == 1 and seen["state"]["hung_kills"] == 0
    assert len(pids["mixed-0"]) == 2


def test_a_restarted_worker_that_never_listens_is_killed_after_startup_timeout(tmp_path: Path) -> None:
    config = config_for(restart=RestartSpec(initial_delay=0.5), liveness=PROBES, startup_timeout=4)
    env = {"STARTED": str(tmp_path / "started"), "START_DELAY": "3600"}
    plan = plan_for(config, env)

    def steps(out: io.StringIO, supervisor: sup.Supervisor, seen: dict) -> None:
        first = supervisor.servers[0].pid
        os.kill(first, signal.SIGKILL)
        wait_output(out, r"^\[up\] started mixed-0 \(pid \d+\)", 10)
        wait_for(lambda: supervisor.servers[0].pid != first, 10, "restarted")
        seen["loading"] = loading = supervisor.servers[0].pid
        wait_output(out, rf"^\[up\] mixed-0 \(pid {loading}\) exited with signal SIGTERM", 30)

    output, pids, seen = run_steps(config, plan, tmp_path, steps)
    hung = [line for line in output.splitlines() if "hung" in line]
    assert hung == [
        f"[up] mixed-0 (pid {seen['loading']}) runs but answered no /health probe in startup_timeout (4 s)"
        " since it started: hung; SIGTERM, then SIGKILL in 1 s, to restart it"
    ], output


def test_liveness_keys_in_the_cluster_file() -> None:
    base = {"mixed": {}, "kv_tier": "memory://"}
    default = LivenessSpec(interval=5.0, timeout=5.0, failure_threshold=3, termination_grace_period=5.0)
    assert parse_config(base).liveness == default
    assert parse_config({**base, "liveness": True}).liveness == default
    spec = parse_config({**base, "liveness": {"interval": 2, "failure_threshold": 5}}).liveness
    assert spec == LivenessSpec(interval=2.0, timeout=5.0, failure_threshold=5, termination_grace_period=5.0)
    spec = parse_config({**base, "liveness": {"termination_grace_period": 45}}).liveness
    assert spec == dataclasses.replace(default, termination_grace_period=45.0)
    assert parse_config(
        {**base, "liveness": {"termination_grace_period": 0}}
    ).liveness == dataclasses.replace(default, termination_grace_period=0.0)
    assert parse_config({**base, "liveness": False}).liveness is None
    assert load_yaml("liveness: false")["liveness"] is False  # what the documented spelling reads as
    expected = (
        "liveness: expected a mapping {interval: …, timeout: …, failure_threshold: …,"
        " termination_grace_period: …}, or false to switch liveness probes off, got "
    )
    for value, message in [
        ({"interval": 0}, "liveness.interval: must be > 0, got 0"),
        ({"timeout": "1s"}, "liveness.timeout: expected a number, got '1s' (str)"),
        (
            {"failure_threshold": 0},
            "liveness.failure_threshold: must be >= 1, got 0 (liveness: false switches liveness probes off)",
        ),
        ({"failure_threshold": 2.5}, "liveness.failure_threshold: expected an integer, got 2.5 (float)"),
        ({"period": 1}, "liveness.period: unknown key"),
        (
            {"termination_grace_period": -1},
            "liveness.termination_grace_period: must be a finite number of seconds >= 0 (0: SIGKILL at once),"
            " got -1",
        ),
        (
            {"termination_grace_period": float("inf")},
            "liveness.termination_grace_period: must be a finite number of seconds >= 0 (0: SIGKILL at once),"
            " got inf",
        ),
        (
            {"termination_grace_period": float("nan")},
            "liveness.termination_grace_period: must be a finite number of seconds >= 0 (0: SIGKILL at once),"
            " got nan",
        ),
        (
            {"termination_grace_period": "30s"},
            "liveness.termination_grace_period: expected a number of seconds, got '30s' (str)",
        ),
        (
            {"termination_grace": 1},
            "liveness.termination_grace: unknown key, did you mean termination_grace_period?",
        ),
        (None, expected + "None (null)"),
        ("off!", expected + "'off!' (str)"),
        (0, expected + "0 (int)"),
    ]:
        with pytest.raises(ConfigError) as e:
            parse_config({**base, "liveness": value})
        assert str(e.value).startswith(message), e.value


def test_the_probes_refused_while_it_started_do_not_count_once_it_answered(tmp_path: Path) -> None:
    """A restarted worker answers the supervisor's readiness probe before any liveness probe: the
    refused probes of its start, still the latest, must not count; those sent after it answered do.
    A stand-in that never listens; its answer to the supervisor is the one thing set by hand."""
    (tmp_path / "started").touch()
    spec = stand_in("mixed-0", "worker", {"STARTED": str(tmp_path / "started"), "START_DELAY": "3600"})
    child = Child(spec, LogSink(io.StringIO()))
    said: list[str] = []
    watch = liveness.Liveness(PROBES, [child], 600.0, said.append)
    child.start()
    try:
        watch.start()
        prober = watch.probers["mixed-0"]
        wait_for(lambda: len(prober.since(0.0)[1]) == 3, 20, "three refused probes")
        assert watch.check(time.monotonic()) is False and said == []  # not answered yet: not counted
        child.healthy_since = answered = time.monotonic()  # the supervisor's probe got its 200
        watch.check(time.monotonic())
        assert said == [] and watch.unanswered.get("mixed-0", 0) < 3
        wait_for(lambda: len(prober.since(answered)[1]) == 3, 20, "three refused probes since")
        assert watch.check(time.monotonic()) is True
        assert said == [
            f"mixed-0 (pid {child.pid}) runs but answered none of the last 3 /health probes"
            " (the last: Connection refused): hung; SIGTERM, then SIGKILL in 1 s, to restart it"
        ]
        assert child.wait(10) and child.exit_code() == -signal.SIGTERM
    finally:
        watch.stop()
        child.signal_group(signal.SIGKILL)
