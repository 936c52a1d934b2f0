"""`bench/soak.py` at a small size: after a mixed load with clients hanging up at every point,
through a router over a replica with API server processes and one that refuses (429) and times out,
every request registry in every process is back to empty, every in-flight gauge to zero, and no
log has an ERROR or a traceback (the soak's exit status says so; the test reads the registries
themselves from the soak's object dumps)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# What a request holds while it runs, by process kind: empty (or 0) when none runs.
REPLICA_IDLE = (
    "engine.async_engine.AsyncEngine._streams",
    "engine.async_engine.AsyncEngine._held",
    "engine.llm_engine.LLMEngine.requests",
    "engine.llm_engine.LLMEngine._held_finals",
    "kvcache.block_copy.BlockCopier._streams",
    "server.generation.Generation._live_ids",
    "server.responses_background.BackgroundResponses._runs",
)
ENGINE_PROCESS_IDLE = (
    "server.admission.HeldPlaces._held",
    "server.admission.HeldPlaces._leased",
    "server.admission.HeldPlaces._refused",
    "server.admission.HeldPlaces.num_held",
    "server.engine_host._ApiServer.requests",
)
API_SERVER_IDLE = (
    "server.engine_client.EngineClient._streams",
    "server.engine_client.EngineClient._calls",
    "server.engine_client.EngineClient._unsent",
    "server.generation.Generation._live_ids",
    "server.responses_background.BackgroundResponses._runs",
)
ROUTER_IDLE = (
    "router.replica.Replica.inflight",
    "router.replica.Replica.inflight_tokens",
    "router.admission.Admission._waiters",
)


def test_a_small_soak_leaves_every_process_idle(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    argv = ["--requests", "150", "--rounds", "1", "--concurrency", "8", "--settle", "3", "--objects"]
    run = subprocess.run(
        [sys.executable, "-m", "bench.soak", *argv, "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-6000:]
    report = json.loads(out.read_text())
    assert report["log_errors"] == {}
    statuses = report["load"][0]["statuses"]
    kinds = {key.split(":", 1)[1] for key in statuses}
    # The seeded plan: every way of hanging up, answered requests and refused bodies.
    assert {"hangup-before", "hangup-head", "hangup-mid", "hangup-end", "200", "400"} <= kinds
    assert sum(statuses.values()) == 150

    after = report["snapshots"][-1]
    state = after["state"]
    by_kind = {"engine": [], "api": [], "single": [], "router": []}
    for proc, sizes in state.items():
        if proc.startswith("router"):
            by_kind["router"].append(sizes)
        elif "server.engine_host._ApiServer.requests" in sizes:
            by_kind["engine"].append(sizes)
        elif "server.engine_client.EngineClient._streams" in sizes:
            by_kind["api"].append(sizes)
        elif "engine.async_engine.AsyncEngine._streams" in sizes:
            by_kind["single"].append(sizes)
    # Replica a: one engine process, two API servers; replica b: one process; the router.
    assert [len(by_kind[k]) for k in ("engine", "api", "single", "router")] == [1, 2, 1, 1]
    for sizes in by_kind["engine"]:
        assert {k: sizes.get(k, 0) for k in ENGINE_PROCESS_IDLE} == dict.fromkeys(ENGINE_PROCESS_IDLE, 0)
    for sizes in [*by_kind["engine"], *by_kind["single"]]:
        engine_keys = [k for k in REPLICA_IDLE if k in sizes]
        assert "engine.async_engine.AsyncEngine._streams" in engine_keys
        assert {k: sizes[k] for k in engine_keys} == dict.fromkeys(engine_keys, 0)
    for sizes in by_kind["api"]:
        assert {k: sizes.get(k, 0) for k in API_SERVER_IDLE} == dict.fromkeys(API_SERVER_IDLE, 0)
    (router,) = by_kind["router"]
    assert all(k in router for k in ROUTER_IDLE[:2])
    assert {k: router.get(k, 0) for k in ROUTER_IDLE} == dict.fromkeys(ROUTER_IDLE, 0)
    assert after["router_load"] == 0 and after["a_load"] == 0 and after["b_load"] == 0
