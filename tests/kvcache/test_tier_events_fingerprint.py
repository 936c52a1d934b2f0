"""A weight update changes the connector's fingerprint while its writer thread still holds writes and
events of the old weights (the tier is slow): they must still go to the old model's event stream, and
only what is queued after the change to the new one. A real Redis; the slow write is forced by a hook
that holds the tier's ``put_many`` until the test lets it go."""

from __future__ import annotations

import threading

import torch

from kvcache.connector import KVConnector
from kvcache.events import KVEventReader
from kvcache.keys import block_hashes

SHAPE = (2, 2, 16, 2, 8)
HASHES = block_hashes(list(range(16 * 4)), 16)
HEX = [h.hex() for h in HASHES]


def _events(redis_url: str, fingerprint: str) -> list[tuple[str, str, tuple[str, ...]]]:
    reader = KVEventReader(redis_url, fingerprint)
    try:
        return [(e.kind, e.medium, e.block_hashes) for e in reader.read()]
    finally:
        reader.close()


def test_events_queued_before_a_weight_update_stay_on_the_old_models_stream(redis_url: str) -> None:
    """Before: ``set_fingerprint`` waited (5 s at most) for the queue to drain, then switched the
    publisher's stream; a tier slower than that got the old weights' blocks announced on the new
    model's stream, where a cache-aware router took them for blocks of the new weights."""
    k = [torch.randn(4, 16, 2, 8) for _ in range(2)]
    v = [torch.randn(4, 16, 2, 8) for _ in range(2)]
    with KVConnector(redis_url + "?ttl=60", "fp-old", SHAPE, torch.float32, events=True) as conn:
        put_many = conn.tier.put_many
        writing, release = threading.Event(), threading.Event()

        def slow_put_many(items):  # noqa: ANN001, ANN202
            if not release.is_set():
                writing.set()
                release.wait(30)
            return put_many(items)

        conn.tier.put_many = slow_put_many
        try:
            assert conn.save_many(HASHES[:2], [0, 1], k, v) == 2
            assert writing.wait(30)  # the writer holds the old weights' writes
            assert conn.publish_event("removed", HASHES[2:3])  # queued behind them
            conn.set_fingerprint("fp-new")
            assert conn.publish_event("cleared", [])
            assert conn.save_many(HASHES[3:4], [3], k, v) == 1
        finally:
            release.set()
        assert conn.flush(30)
    assert _events(redis_url, "fp-old") == [
        ("stored", "tier", (HEX[0], HEX[1])),
        ("removed", "device", (HEX[2],)),
    ]
    # (one batch of the writer: its writes' events go out before the device events queued with them)
    assert _events(redis_url, "fp-new") == [
        ("stored", "tier", (HEX[3],)),
        ("cleared", "device", ()),
    ]
