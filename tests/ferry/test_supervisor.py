"""The supervisor's life cycle on small real processes (a stdlib HTTP server answering /health):
crash-loop back-off, where the router is probed, a failing child's last lines, the child Redis'
directory. Stopping (drain order, signals) is in test_supervisor_stop.py.

Workers and router here are stand-ins so each scenario runs in seconds; tests/ferry/test_up.py runs
the same supervisor over real `ferry serve` / `ferry router` processes."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    STAND_IN,
    SlowTerminal,
    config_for,
    free_port,
    run_supervisor,
    stand_in,
    wait_gone,
    wait_output,
)

from ferry.cluster import supervisor as sup
from ferry.cluster.child import LogSink
from ferry.cluster.plan import ClusterPlan, ProcessSpec, build_plan
from ferry.cluster.spec import KVTierSpec, RedisSpec, RestartSpec, RouterSpec


def test_crash_loop_backs_off_exponentially(tmp_path: Path) -> None:
    worker = stand_in("mixed-0", "worker", {"LIFETIME": "1.5"})
    router = stand_in("router", "router")
    plan = ClusterPlan("memory://", None, (worker,), router, router.url)
    config = config_for(restart=RestartSpec(initial_delay=0.2, max_delay=0.5, reset_after=60))

    def act(out: io.StringIO, supervisor: sup.Supervisor) -> None:
        wait_output(out, r"restarting in 0\.5 s", 60)
        os.kill(os.getpid(), signal.SIGTERM)

    code, output, pids = run_supervisor(config, plan, tmp_path, act)
    assert code == 0
    delays = re.findall(
        r"^\[up\] mixed-0 \(pid \d+\) exited with exit code 3; restarting in ([\d.]+) s$", output, re.M
    )
    assert delays == ["0.2", "0.4", "0.5"]  # doubled, then capped at max_delay
    assert len(pids["mixed-0"]) >= 3 and len(set(pids["mixed-0"])) == len(pids["mixed-0"])
    assert re.search(r"^\[mixed-0\] listening$", output, re.M)  # children's lines, prefixed
    assert wait_gone([p for ps in pids.values() for p in ps], 60) == []


def test_a_router_on_another_address_is_probed_there(tmp_path: Path) -> None:
    """router.host 127.0.0.2 (or ::1, a LAN address): the router answers only there, so that is
    where ferry up must look for it (probing 127.0.0.1 waited out the whole startup_timeout)."""
    port = free_port()
    config = config_for(router=RouterSpec(host="127.0.0.2", port=port), startup_timeout=20.0)
    plan = build_plan(config)
    assert plan.endpoint == f"http://127.0.0.2:{port}" and plan.router.url == plan.endpoint
    # The plan's router, run by a stand-in that listens where `ferry router --host` would.
    router = dataclasses.replace(
        plan.router, argv=(sys.executable, "-c", STAND_IN, str(port)), env={"HOST": "127.0.0.2"}
    )
    plan = dataclasses.replace(plan, workers=(stand_in("mixed-0", "worker"),), router=router)

    def act(out: io.StringIO, supervisor: sup.Supervisor) -> None:
        os.kill(os.getpid(), signal.SIGTERM)

    code, output, pids = run_supervisor(config, plan, tmp_path, act)
    assert code == 0
    assert f"[up] ready: http://127.0.0.2:{port} (router; 1 mixed; KV tier memory://)" in output
    assert wait_gone([p for ps in pids.values() for p in ps], 60) == []


def test_a_child_that_cannot_start_shows_its_last_lines_before_the_verdict(tmp_path: Path) -> None:
    """The error line says the child's output is above: its last lines (why it failed) must be,
    even when the terminal lags behind the child."""
    script = (
        "import sys; [print('loading', i) for i in range(300)]; print('ValueError: the reason'); sys.exit(2)"
    )
    worker = ProcessSpec("mixed-0", "worker", (sys.executable, "-c", script), free_port())
    router = stand_in("router", "router")
    out = SlowTerminal()
    supervisor = sup.Supervisor(
        config_for(), ClusterPlan("memory://", None, (worker,), router, router.url), LogSink(out)
    )
    try:
        code = supervisor.run()
    finally:
        for child in supervisor.children:
            child.signal_group(signal.SIGKILL)
    assert code == 1
    lines = out.getvalue().splitlines()
    verdict = next(i for i, line in enumerate(lines) if line.startswith("[up] error: mixed-0 exited"))
    assert lines[verdict].startswith(
        "[up] error: mixed-0 exited with exit code 2 before the cluster was ready (its output is above,"
    )
    assert lines.index("[mixed-0] ValueError: the reason") == verdict - 1
    # mixed-0 has exited: only the router is left to stop.
    assert lines[-2:] == ["[up] stopping the router (drain up to 30 s)", "[up] stopped"]
    assert wait_gone([p for c in supervisor.children for p in c.pids], 60) == []


def test_a_crashed_childs_last_lines_come_before_the_restart_line(tmp_path: Path) -> None:
    worker = stand_in("mixed-0", "worker", {"LIFETIME": "3", "LAST_WORDS": "300"})
    router = stand_in("router", "router")
    plan = ClusterPlan("memory://", None, (worker,), router, router.url)
    config = config_for(restart=RestartSpec(initial_delay=30, max_delay=30, reset_after=60))

    def act(out: io.StringIO, supervisor: sup.Supervisor) -> None:
        wait_output(out, r"restarting in 30 s$", 60)
        os.kill(os.getpid(), signal.SIGTERM)

    code, output, pids = run_supervisor(config, plan, tmp_path, act, SlowTerminal())
    assert code == 0
    lines = output.splitlines()
    crash = next(i for i, line in enumerate(lines) if " exited with " in line)
    assert re.fullmatch(
        r"\[up\] mixed-0 \(pid \d+\) exited with exit code 3; restarting in 30 s", lines[crash]
    )
    assert lines[crash - 2 : crash] == ["[mixed-0]   File 299", "[mixed-0] exiting"]
    assert wait_gone([p for ps in pids.values() for p in ps], 60) == []


def test_the_child_redis_runs_in_a_fresh_directory_removed_at_exit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis loads the dump.rdb of its working directory: started in the user's, where a Redis
    once saved, the cluster's "fresh" KV tier came up holding that Redis' keys."""
    import redis

    old = tmp_path / "old"
    old.mkdir()
    port = free_port()
    argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(old)]
    saver = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port)
        deadline = time.monotonic() + 60
        while True:
            try:
                client.set("stale", "1")
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        client.save()
    finally:
        saver.kill()
        saver.wait()
    assert sorted(p.name for p in old.iterdir()) == ["dump.rdb"]
    monkeypatch.chdir(old)

    config = dataclasses.replace(config_for(), kv_tier=KVTierSpec(redis=RedisSpec()))
    plan = build_plan(config)
    plan = dataclasses.replace(
        plan, workers=(stand_in("mixed-0", "worker"),), router=stand_in("router", "router")
    )
    seen: dict[str, object] = {}

    def act(out: io.StringIO, supervisor: sup.Supervisor) -> None:
        tier = redis.Redis.from_url(plan.kv_tier_url)
        seen["keys"] = tier.keys("*")
        seen["cwd"] = os.readlink(f"/proc/{supervisor.redis.pid}/cwd")
        tier.set("written", "1")
        tier.save()  # a SAVE from any client lands in ferry up's directory, not the user's
        os.kill(os.getpid(), signal.SIGTERM)

    code, output, pids = run_supervisor(config, plan, tmp_path, act)
    assert code == 0 and seen["keys"] == []
    assert seen["cwd"] != str(old) and Path(str(seen["cwd"])).name.startswith("ferry-redis-")
    assert not Path(str(seen["cwd"])).exists()
    assert sorted(p.name for p in old.iterdir()) == ["dump.rdb"]
    assert wait_gone([p for ps in pids.values() for p in ps], 60) == []


def test_the_ready_line_and_state_file_mask_the_kv_tier_password(tmp_path: Path) -> None:
    config = dataclasses.replace(config_for(), kv_tier=KVTierSpec(url="redis://ferry:s3cret@127.0.0.1:1/0"))
    plan = dataclasses.replace(
        build_plan(config), workers=(stand_in("mixed-0", "worker"),), router=stand_in("router", "router")
    )
    state: dict = {}

    def act(out: io.StringIO, supervisor: sup.Supervisor) -> None:
        state.update(json.loads((tmp_path / "state.json").read_text()))
        os.kill(os.getpid(), signal.SIGTERM)

    code, output, pids = run_supervisor(config, plan, tmp_path, act)
    assert code == 0
    assert (
        "[up] ready: " + plan.endpoint + " (router; 1 mixed; KV tier redis://ferry:***@127.0.0.1:1/0)"
        in output
    )
    assert state["kv_tier"] == "redis://ferry:***@127.0.0.1:1/0"
    assert "s3cret" not in output + json.dumps(state)
    assert wait_gone([p for ps in pids.values() for p in ps], 60) == []
