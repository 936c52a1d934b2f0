"""A KV tier that hangs without exiting (SIGSTOP here, as a stuck disk would): the supervisor's own
redis-server, once ``tier_watch.HUNG_AFTER`` PINGs in a row go unanswered, is killed (said once,
with why) and restarted on the same port like a crashed child; an existing tier (the test's own
redis-server) is watched the same way but never killed. PINGs every 0.1 s, each waiting up to 1 s;
workers and router are stand-ins (tests/ferry/conftest.py). Last, the watcher's count the
supervisor judges by, on its own."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import signal
import time
import traceback
from pathlib import Path

import pytest
import redis
from conftest import alive, config_for, run_steps, run_supervisor, stand_in, wait_gone, wait_output

from ferry.cluster import supervisor as sup
from ferry.cluster import tier_watch
from ferry.cluster.plan import build_plan
from ferry.cluster.spec import KVTierSpec, RedisSpec, RestartSpec


@pytest.fixture(autouse=True)
def often(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tier_watch, "CHECK_INTERVAL_S", 0.1)
    monkeypatch.setattr(tier_watch, "CHECK_TIMEOUT_S", 1.0)


def process_state(pid: int) -> str:
    """The one-letter state in /proc/PID/stat (``T``: stopped)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0]


def wait_state(path: Path, ok: bool, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = json.loads(path.read_text())
        if state["kv_tier_ok"] is ok:
            return state
        assert time.monotonic() < deadline, f"kv_tier_ok never {ok}: {state}"
        time.sleep(0.05)


def plan_for(config):
    return dataclasses.replace(
        build_plan(config), workers=(stand_in("mixed-0", "worker"),), router=stand_in("router", "router")
    )


def test_a_hung_child_redis_is_killed_and_restarted(tmp_path: Path) -> None:
    config = dataclasses.replace(
        config_for(), kv_tier=KVTierSpec(redis=RedisSpec()), restart=RestartSpec(initial_delay=0.5)
    )
    plan = plan_for(config)
    url = plan.kv_tier_url
    state_file = tmp_path / "state.json"

    def steps(out: io.StringIO, supervisor: sup.Supervisor, seen: dict) -> None:
        seen["victim"] = victim = supervisor.redis.pid
        os.kill(victim, signal.SIGSTOP)  # hangs: the process is there, nothing answers
        seen["away"] = wait_state(state_file, False, 60)
        wait_output(out, rf"^\[up\] redis \(pid {victim}\) exited with signal SIGKILL; restarting in", 60)
        seen["back"] = wait_state(state_file, True, 60)
        wait_output(out, r"^\[up\] the KV tier .* answers again", 60)
        seen["pong"] = redis.Redis.from_url(url, socket_timeout=5).ping()
        time.sleep(1.0)  # PINGs of the new Redis go on: none of them kills it
        seen["last"] = json.loads(state_file.read_text())

    output, pids, seen = run_steps(config, plan, tmp_path, steps)
    victim = seen["victim"]
    away, back = seen["away"], seen["back"]
    assert away["ready"] is True and "Timeout" in away["kv_tier_error"], away
    assert back["kv_tier_ok"] is True and back["kv_tier_since"] > away["kv_tier_since"]
    assert seen["pong"] is True
    redis_state = next(p for p in seen["last"]["processes"] if p["name"] == "redis")
    assert redis_state["pids"][0] == victim and len(redis_state["pids"]) == 2 and redis_state["restarts"] == 1
    assert redis_state["url"] == url and redis_state["pid"] != victim
    assert not alive(victim)
    lines = output.splitlines()
    why = [line for line in lines if "hung" in line]
    assert len(why) == 1 and re.fullmatch(
        rf"\[up\] redis \(pid {victim}\) runs but answered none of the last {tier_watch.HUNG_AFTER} PINGs"
        r" \(the last: Timeout [^)]+\): hung; SIGKILL, to restart it",
        why[0],
    ), output
    assert f"[up] redis is healthy again (pid {redis_state['pid']})" in lines
    # The kill is said first, then the restart that follows any exit.
    exited = f"[up] redis (pid {victim}) exited with signal SIGKILL; restarting in 0.5 s"
    assert lines.index(why[0]) < lines.index(exited)
    assert wait_gone([p for ps in pids.values() for p in ps], 60) == []


def test_an_existing_tier_that_hangs_is_never_killed(tmp_path: Path, private_redis) -> None:
    server = private_redis()
    config = dataclasses.replace(config_for(), kv_tier=KVTierSpec(url=server.url))
    plan = plan_for(config)
    pid = server.proc.pid
    seen: dict[str, object] = {}

    def act(out: io.StringIO, supervisor: sup.Supervisor) -> None:
        try:
            os.kill(pid, signal.SIGSTOP)
            seen["away"] = wait_state(tmp_path / "state.json", False, 60)
            # Enough unanswered PINGs that our own Redis would have been killed, then some more.
            deadline = time.monotonic() + 60
            while supervisor.tier_watcher.unanswered_since(0.0) < tier_watch.HUNG_AFTER:
                assert time.monotonic() < deadline, "the PINGs of a stopped Redis did not go unanswered"
                time.sleep(0.05)
            time.sleep(2.0)
            seen["alive"] = alive(pid)
            seen["stopped"] = process_state(pid)
            os.kill(pid, signal.SIGCONT)
            seen["back"] = wait_state(tmp_path / "state.json", True, 60)
        except BaseException:
            seen["error"] = traceback.format_exc()
        finally:
            os.kill(pid, signal.SIGCONT)
            os.kill(os.getpid(), signal.SIGTERM)

    code, output, pids = run_supervisor(config, plan, tmp_path, act)
    assert "error" not in seen, f"{seen.get('error')}\n{output}"
    assert code == 0
    assert seen["alive"] is True and seen["stopped"] == "T", seen
    assert seen["away"]["kv_tier_ok"] is False and seen["back"]["kv_tier_ok"] is True
    assert "hung" not in output and "SIGKILL" not in output, output
    assert server.proc.poll() is None and redis.Redis.from_url(server.url, socket_timeout=5).ping()
    assert wait_gone([p for ps in pids.values() for p in ps], 60) == []


def wait_until(done, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_the_watcher_counts_unanswered_pings_since_a_time(private_redis) -> None:
    """What the supervisor judges a hang by: the latest PINGs in a row left unanswered (at most
    HUNG_AFTER), only those sent since a given time (a restarted Redis' own), none after an answer."""
    server = private_redis()
    server.stop()  # the port is closed: every PING is refused
    watcher = tier_watch.TierWatcher(server.url, 0.05, 1.0)
    watcher.start()
    try:
        assert wait_until(lambda: watcher.unanswered_since(0.0) == tier_watch.HUNG_AFTER, 60)
        time.sleep(0.3)
        assert watcher.unanswered_since(0.0) == tier_watch.HUNG_AFTER  # capped
        # Older PINGs do not count (a later ``since`` than any PING sent: none, however many were
        # sent while a loaded machine held this thread).
        assert watcher.unanswered_since(time.monotonic() + 3600) == 0
        since = time.monotonic()
        assert wait_until(lambda: watcher.unanswered_since(since) == tier_watch.HUNG_AFTER, 60)
        server.start()  # the same port
        assert wait_until(lambda: (watcher.latest() or tier_watch.TierCheck(False)).ok, 60)
        assert watcher.unanswered_since(0.0) == 0
    finally:
        watcher.stop()


def test_a_refused_password_is_an_answer(private_redis) -> None:
    server = private_redis(password="s3cret")
    watcher = tier_watch.TierWatcher(server.url, 0.05, 1.0)  # no password in the URL
    watcher.start()
    try:
        assert wait_until(lambda: watcher.latest() is not None, 60)
        time.sleep(0.5)
        check = watcher.latest()
        assert (check.ok, check.problem) == (False, "cannot log in to"), check
        assert watcher.unanswered_since(0.0) == 0
    finally:
        watcher.stop()
