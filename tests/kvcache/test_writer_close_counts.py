"""``BlockWriter.close(timeout)`` against a tier that does not answer in time: every block handed
over still ends counted exactly once, as written or dropped, when ``close`` returns, and the
writer thread that answers later counts nothing twice. A real Redis, stopped with SIGSTOP so the
write in progress (and the ones queued behind it) outlive the close's timeout."""

from __future__ import annotations

import os
import signal

import torch

from kvcache.keys import block_hashes
from kvcache.tier import open_tier
from kvcache.writer import WRITE_BATCH, BlockWrite, BlockWriter

BLOCK = 4
NUM = WRITE_BATCH + 8  # one batch in flight when Redis stops, 8 writes queued behind it
HASHES = block_hashes(list(range(BLOCK * NUM)), BLOCK)


def _writes() -> list[BlockWrite]:
    return [BlockWrite(h, torch.full((1, 2, BLOCK, 1, 2), float(i))) for i, h in enumerate(HASHES)]


def test_close_timing_out_on_a_stalled_redis_counts_every_block_once(private_redis, metric) -> None:
    srv = private_redis()
    # A socket timeout far beyond the close's: the stalled write is still waiting when close gives up.
    tier = open_tier(srv.url + "?timeout=30")
    writer = BlockWriter(tier, "fp", capacity=NUM)
    dropped_before = metric("ferry:kv_tier_dropped_writes_total")
    closed_before = metric("ferry:kv_tier_dropped_writes_total", reason="closed")
    os.kill(srv.proc.pid, signal.SIGSTOP)
    try:
        assert writer.reserve(NUM) == NUM
        writer.submit(_writes())
        writer.close(0.5)
        # Nothing reached Redis; close gave up on all of it, so all of it is dropped, now.
        assert (writer.written, writer.dropped, writer.pending) == (0, NUM, 0)
        assert metric("ferry:kv_tier_dropped_writes_total") == dropped_before + NUM
        assert metric("ferry:kv_tier_dropped_writes_total", reason="closed") == closed_before + NUM
    finally:
        os.kill(srv.proc.pid, signal.SIGCONT)
    # Redis answers again: the stalled batch's SETs may now succeed, but close counted them already.
    writer._thread.join(60)
    assert not writer._thread.is_alive()
    assert (writer.written, writer.dropped, writer.pending) == (0, NUM, 0)
    assert metric("ferry:kv_tier_dropped_writes_total") == dropped_before + NUM
    tier.close()


def test_close_with_a_live_redis_writes_everything(private_redis, metric) -> None:
    """The same writes with Redis answering: close waits for them, all written, none dropped."""
    srv = private_redis()
    tier = open_tier(srv.url)
    writer = BlockWriter(tier, "fp", capacity=NUM)
    dropped_before = metric("ferry:kv_tier_dropped_writes_total")
    assert writer.reserve(NUM) == NUM
    writer.submit(_writes())
    writer.close(30.0)
    assert (writer.written, writer.dropped, writer.pending) == (NUM, 0, 0)
    assert metric("ferry:kv_tier_dropped_writes_total") == dropped_before
    tier.close()
