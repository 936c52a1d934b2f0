"""``KVConnector.stats()`` reads the writer's counts as one snapshot: a block is counted saved or
pending, never both. The writer counts a batch's writes, then publishes their KV events, and only
then gives back the batch's slots; a real Redis for the events, stopped with SIGSTOP, holds it
between the two for as long as the test needs."""

from __future__ import annotations

import os
import signal
import time

import torch

from kvcache.connector import KVConnector
from kvcache.keys import block_hashes

NUM_LAYERS, BLOCK, KV_HEADS, HEAD_DIM, NUM_BLOCKS = 2, 4, 1, 2, 3
SHAPE = (NUM_LAYERS, 2, BLOCK, KV_HEADS, HEAD_DIM)
HASHES = block_hashes(list(range(BLOCK * 2)), BLOCK)


def _saved(conn: KVConnector, n: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if conn.stats().blocks_saved == n:
            return True
        time.sleep(0.01)
    return False


def test_a_saved_block_whose_events_are_still_publishing_is_not_pending(private_redis) -> None:
    srv = private_redis()
    caches = [torch.ones(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM) for _ in range(NUM_LAYERS)]
    # A socket timeout far beyond the test's: the event publish waits for as long as Redis is stopped.
    events_url = srv.url + "?socket_timeout=60"
    with KVConnector("memory://", "fp", SHAPE, torch.float32, events=True, events_url=events_url) as conn:
        os.kill(srv.proc.pid, signal.SIGSTOP)
        try:
            assert conn.save_many(HASHES, [0, 1], caches, caches) == 2
            assert _saved(conn, 2)
            s = conn.stats()  # the writer is held publishing the batch's "stored" events
            assert (s.blocks_saved, s.writes_dropped, s.pending_writes) == (2, 0, 0)
            assert conn._writer.pending == 2  # the slots come back only after the publish
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        assert conn.flush(30.0)
        s = conn.stats()
        assert (s.blocks_saved, s.writes_dropped, s.pending_writes) == (2, 0, 0)
