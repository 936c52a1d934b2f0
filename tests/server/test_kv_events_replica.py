"""KV events carry the replica's URL, which routers' cache-aware policies match events by, and its
engine's instance id, by which they tell a restarted replica's blocks from the old process's."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import httpx
import redis

from engine.config import EngineConfig
from kvcache.events import KVEventReader
from kvcache.keys import KEY_PREFIX, block_hashes, to_hex
from server.args import add_serve_args, engine_options


def _options(*argv: str) -> dict:
    return engine_options(add_serve_args(argparse.ArgumentParser()).parse_args(list(argv)))


def test_replica_id_defaults_to_the_advertised_url() -> None:
    assert _options("--port", "8123")["kv_events_replica_id"] == "http://127.0.0.1:8123"
    opts = _options("--host", "10.1.2.3", "--port", "9000")
    assert opts["kv_events_replica_id"] == "http://10.1.2.3:9000"
    opts = _options("--port", "9000", "--advertise-url", "http://replica-0.ferry:8000/")
    assert opts["kv_events_replica_id"] == "http://replica-0.ferry:8000"
    opts = _options("--advertise-url", "http://a:1", "--kv-events-replica-id", "pod-7")
    assert opts["kv_events_replica_id"] == "pod-7"
    assert EngineConfig.from_options(**opts).kv_events_replica_id == "pod-7"


def test_served_events_carry_the_advertised_url(
    tiny_llama: Path, redis_url: str, server_process, serve_logs: Path
) -> None:
    advertised = "http://replica-under-test.local:8000"
    srv = server_process(
        tiny_llama,
        ["--kv-tier", redis_url, "--kv-events", "--advertise-url", advertised, "--num-kv-blocks", "64"],
        serve_logs,
    ).start()
    try:
        prompt = [(3 * i + 7) % 900 + 10 for i in range(40)]  # 2 full blocks of 16
        body = {"model": srv.model_name, "prompt": prompt, "max_tokens": 4, "temperature": 0}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        instance = httpx.get(srv.url + "/health", timeout=10).json()["instance_id"]
        raw = redis.Redis.from_url(redis_url)
        events_prefix = f"{KEY_PREFIX}:events:"
        want = set(to_hex(block_hashes(prompt, 16)))
        assert len(want) == 2
        events = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not want <= _stored_on_device(
            [e for e in events if e.instance == instance]
        ):
            streams = [k.decode() for k in raw.scan_iter(match=events_prefix + "*")]
            if streams:
                assert len(streams) == 1  # the db was flushed: only this model's stream
                reader = KVEventReader(redis_url, streams[0][len(events_prefix) :])
                events = reader.read()
                reader.close()
            time.sleep(0.1)
    finally:
        srv.stop()
    # Another live replica of the model on this Redis (a session-scoped one) may publish to the same
    # stream, for instance re-publishing its blocks after the test's flush: this engine's events are
    # those of its instance, as /health names it (a router tells a restart by it).
    mine = [e for e in events if e.instance == instance]
    assert want <= _stored_on_device(mine)
    assert {e.replica_id for e in mine} == {advertised}
    assert {e.instance for e in events if e.replica_id == advertised} == {instance}


def _stored_on_device(events: list) -> set[str]:
    return {h for e in events if e.kind == "stored" and e.medium == "device" for h in e.block_hashes}
