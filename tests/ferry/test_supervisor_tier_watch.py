"""The supervisor watches the KV tier once the cluster is up: its own redis-server, killed, is started
again on the same port like any crashed child, and the PINGs every ``--kv-tier-check-interval``
seconds (here 0.1) say the tier went away and came back, once each, in the log and in the state
file. Workers and router are stand-ins (tests/ferry/test_up_kv_tier_watch.py runs real ones against
a Redis of the test's own)."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import signal
from pathlib import Path

import pytest
import redis
from conftest import config_for, run_steps, run_supervisor, stand_in, wait_gone, wait_output

from ferry.cluster import supervisor as sup
from ferry.cluster import tier_watch
from ferry.cluster.plan import build_plan
from ferry.cluster.spec import KVTierSpec, RedisSpec, RestartSpec

AWAY_TAIL = "; the workers serve on, recomputing what they would have loaded, until it answers again"


@pytest.fixture(autouse=True)
def often(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tier_watch, "CHECK_INTERVAL_S", 0.1)


def test_a_child_redis_that_dies_is_restarted_and_the_state_file_follows_it(tmp_path: Path) -> None:
    config = dataclasses.replace(
        config_for(),
        kv_tier=KVTierSpec(redis=RedisSpec()),
        # A long back-off keeps the tier away for a while: PINGs every 0.1 s surely see it gone.
        restart=RestartSpec(initial_delay=3.0),
    )
    plan = dataclasses.replace(
        build_plan(config), workers=(stand_in("mixed-0", "worker"),), router=stand_in("router", "router")
    )
    url = plan.kv_tier_url

    def state() -> dict:
        return json.loads((tmp_path / "state.json").read_text())

    def steps(out: io.StringIO, supervisor: sup.Supervisor, seen: dict) -> None:
        seen["ready"] = state()
        seen["victim"] = victim = supervisor.redis.pid
        os.kill(victim, signal.SIGKILL)
        wait_output(out, r"^\[up\] warning: cannot reach the KV tier ", 60)
        seen["away"] = state()
        wait_output(out, r"^\[up\] the KV tier .* answers again", 60)
        seen["back"] = state()
        seen["pong"] = redis.Redis.from_url(url, socket_timeout=5).ping()

    output, pids, seen = run_steps(config, plan, tmp_path, steps)
    victim = seen["victim"]
    ready, away, back = seen["ready"], seen["away"], seen["back"]
    assert (ready["ready"], ready["kv_tier"], ready["kv_tier_ok"], ready["kv_tier_error"]) == (
        True,
        url,
        True,
        None,
    )
    assert isinstance(ready["kv_tier_since"], float)
    # Away: said in the state file, while the cluster stays ready (the workers serve on).
    assert away["ready"] is True and away["kv_tier_ok"] is False
    assert isinstance(away["kv_tier_error"], str) and away["kv_tier_error"]
    assert away["kv_tier_since"] > ready["kv_tier_since"]
    # Back: the child Redis was started again on the same port, as a crashed worker is.
    assert back["ready"] is True and back["kv_tier_ok"] is True and back["kv_tier_error"] is None
    assert back["kv_tier_since"] > away["kv_tier_since"]
    assert seen["pong"] is True
    redis_state = next(p for p in back["processes"] if p["name"] == "redis")
    assert redis_state["pids"][0] == victim and len(redis_state["pids"]) == 2 and redis_state["restarts"] == 1
    assert redis_state["url"] == url and redis_state["pid"] != victim
    lines = output.splitlines()
    assert f"[up] redis (pid {victim}) exited with signal SIGKILL; restarting in 3 s" in lines
    assert f"[up] redis is healthy again (pid {redis_state['pid']})" in lines
    # Said once each way, however many PINGs failed in between.
    away_lines = [line for line in lines if "the KV tier" in line and "warning" in line]
    assert len(away_lines) == 1, output
    assert away_lines[0].startswith(f"[up] warning: cannot reach the KV tier {url}: ")
    assert away_lines[0].endswith(AWAY_TAIL)
    back_lines = [line for line in lines if line.startswith("[up] the KV tier ")]
    assert len(back_lines) == 1 and re.fullmatch(
        rf"\[up\] the KV tier {re.escape(url)} answers again \(after \d+\.\d s\)", back_lines[0]
    ), output
    assert lines.index(away_lines[0]) < lines.index(back_lines[0])
    assert wait_gone([p for ps in pids.values() for p in ps], 60) == []


def test_a_memory_tier_is_not_watched(tmp_path: Path) -> None:
    config = config_for()
    plan = dataclasses.replace(
        build_plan(config), workers=(stand_in("mixed-0", "worker"),), router=stand_in("router", "router")
    )
    seen: dict[str, object] = {}

    def act(out: io.StringIO, supervisor: sup.Supervisor) -> None:
        try:
            seen["state"] = json.loads((tmp_path / "state.json").read_text())
            seen["watcher"] = getattr(supervisor, "tier_watcher", "no such attribute")
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    code, output, pids = run_supervisor(config, plan, tmp_path, act)
    assert code == 0 and seen["watcher"] is None
    state = seen["state"]
    assert (state["kv_tier"], state["kv_tier_ok"], state["kv_tier_error"], state["kv_tier_since"]) == (
        "memory://",
        None,
        None,
        None,
    )
    assert "KV tier memory://" in output and "warning" not in output
    assert wait_gone([p for ps in pids.values() for p in ps], 60) == []
