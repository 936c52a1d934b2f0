"""``GET /admin/replicas`` shows the LoRA work the router still owes each replica
(router/lora_admin.py): the adapters a replica that missed their load gets at its next good probe,
and the unloads it missed, and when they are tried next; all empty once it has caught up."""

from __future__ import annotations

from pathlib import Path

import httpx
from router_harness import Cluster, free_port, replicas_view, wait_until

from engine.demo import build_lora_adapter

LORA_FLAGS = ("--enable-lora", "--allow-runtime-lora-updating")
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
NOTHING_OWED = {"restore": [], "unloads": [], "next_try_in_s": None, "mismatched": []}


def test_admin_view_shows_a_replicas_pending_lora_work(
    cluster: Cluster, tiny_llama: Path, tmp_path: Path
) -> None:
    adapter = build_lora_adapter(tmp_path / "kept", tiny_llama, seed=7, alpha=32)
    live = cluster.replicas(1, *LORA_FLAGS)[0]
    late_port = free_port()  # named to the router now, started later
    late = f"http://127.0.0.1:{late_port}"
    router = cluster.router("--replica", live.url, "--replica", late)
    assert wait_until(lambda: replicas_view(router)[live.url]["routable"], 30)
    for path, body in (
        (LOAD, {"lora_name": "kept", "lora_path": str(adapter)}),
        (LOAD, {"lora_name": "gone", "lora_path": str(adapter)}),
        (UNLOAD, {"lora_name": "gone"}),
    ):
        r = httpx.post(router.url + path, json=body, timeout=60)
        assert r.status_code == 502, r.text
        assert r.json()["replicas"] == {live.url: 200, late: 502}
    # Its list as read after the unload (one read between the load and the unload of "gone" names both).
    assert wait_until(lambda: replicas_view(router)[live.url]["models"] == ["llama", "kept"], 30)
    view = replicas_view(router)
    assert view[live.url]["lora_pending"] == NOTHING_OWED
    # The late replica is owed the load of "kept" and the unload of "gone".
    owed = view[late]["lora_pending"]
    # Tried at its next good probe: a replica never seen up is probed at most 8 s apart (the
    # default --probe-backoff-max), and no failed restore made it wait longer.
    assert 0 <= owed.pop("next_try_in_s") <= 8.0
    assert owed == {"restore": ["kept"], "unloads": ["gone"], "mismatched": []}
    assert not view[late]["routable"]

    cluster.replicas(1, *LORA_FLAGS, ports=[late_port])
    assert wait_until(lambda: "kept" in replicas_view(router)[late]["models"], 60)
    view = replicas_view(router)
    assert view[late]["lora_pending"] == NOTHING_OWED
    assert view[late]["models"] == ["llama", "kept"]
    assert view[live.url]["lora_pending"] == NOTHING_OWED
