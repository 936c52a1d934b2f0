"""Torch thread counts around the KV tier's threads (OpenMP backend: the count is per thread, taken at a
thread's first parallel op from a process default that any ``torch.set_num_threads`` overwrites).

The tier's threads run their copies on one thread; the engine loop must still run the model on the
engine's count, and a tier thread must keep one whatever the default is when it first computes. Each
interleaving is forced by a hook on the real object."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
import torch

from engine import SamplingParams
from engine.async_engine import AsyncEngine
from engine.torch_threads import PER_THREAD_NUM_THREADS
from kvcache.connector import KVConnector
from kvcache.keys import block_hashes

pytestmark = pytest.mark.skipif(
    not PER_THREAD_NUM_THREADS, reason="thread counts are per thread under OpenMP only"
)

SHAPE = (2, 2, 16, 2, 8)  # layers, K/V, block size, KV heads, head dim
NUM_BLOCKS = 4


@pytest.fixture
def main_threads() -> Iterator[None]:
    """This thread's count (and the process default) as it was, after the test."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


async def test_the_engine_loop_runs_the_model_on_the_engines_thread_count_with_a_tier(
    tiny_llama, main_threads
) -> None:
    """The tier's writer thread, started as the engine is built, set the process default to one; the
    loop thread, started after it, took that default at its first step: every model step of an
    engine with a KV tier ran on one thread, whatever ``num_threads`` said."""
    eng = AsyncEngine(model=str(tiny_llama), kv_tier="memory://", num_threads=2, num_kv_blocks=64)
    counts: list[int] = []
    execute = eng.engine.model_runner.execute

    def counted(sched):  # noqa: ANN001, ANN202
        counts.append(torch.get_num_threads())
        return execute(sched)

    eng.engine.model_runner.execute = counted
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        async for _ in eng.generate("r", list(range(3, 40)), params):
            pass
    finally:
        await eng.shutdown()
    assert counts and set(counts) == {2}


def test_a_loader_thread_keeps_one_thread_when_the_default_changes_before_its_first_op(
    main_threads,
) -> None:
    """The loader thread set its count to one before its first parallel op, which then took the
    count from the process default of that moment (the engine loop puts it back after each block
    snapshot): the loader's copies ran on every core, competing with the model's own threads."""
    hashes = block_hashes(list(range(16 * NUM_BLOCKS)), 16)
    k = [torch.randn(NUM_BLOCKS, 16, 2, 8) for _ in range(2)]
    v = [torch.randn(NUM_BLOCKS, 16, 2, 8) for _ in range(2)]
    with KVConnector("memory://", "fp", SHAPE, torch.float32) as conn:
        assert conn.save_many(hashes, list(range(NUM_BLOCKS)), k, v) == NUM_BLOCKS
        assert conn.flush(10)
        fetch = conn.tier.fetch
        fetching, default_changed = threading.Event(), threading.Event()
        counts: list[int] = []

        def fetch_once_the_default_changed(keys):  # noqa: ANN001, ANN202
            fetching.set()
            default_changed.wait(30)
            counts.append(torch.get_num_threads())  # the loader thread's first parallel op
            return fetch(keys)

        conn.tier.fetch = fetch_once_the_default_changed
        k2 = [torch.zeros_like(t) for t in k]
        v2 = [torch.zeros_like(t) for t in v]
        loaded = conn.load_async(hashes, list(range(NUM_BLOCKS)), k2, v2)
        assert fetching.wait(30)
        torch.set_num_threads(2)  # another thread puts the process default back meanwhile
        default_changed.set()
        assert loaded.result(30) == NUM_BLOCKS
        assert counts == [1]
        assert all(torch.equal(a, b) for a, b in zip(k + v, k2 + v2, strict=True))


async def test_the_tier_threads_run_on_one_thread_beside_an_engine(tiny_llama, main_threads) -> None:
    """And the engine's fix leaves the tier's own threads at one: the writer encodes on one thread."""
    eng = AsyncEngine(model=str(tiny_llama), kv_tier="memory://", num_threads=2, num_kv_blocks=64)
    connector = eng.engine.connector.kv
    put_many = connector.tier.put_many
    counts: list[int] = []

    def counted(items):  # noqa: ANN001, ANN202
        counts.append(torch.get_num_threads())
        return put_many(items)

    connector.tier.put_many = counted
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        async for _ in eng.generate("r", list(range(3, 40)), params):
            pass
        assert await asyncio.to_thread(connector.flush, 30)
    finally:
        await eng.shutdown()
    assert counts and set(counts) == {1}


async def test_threads_started_after_a_tier_engine_served_compute_on_the_builders_count(
    tiny_llama, main_threads
) -> None:
    """The tier's threads lowered their count with ``torch.set_num_threads(1)``, which also set the
    process default that every later thread takes at its first op: once a tier load had run, the
    checkpoint read of a weight update, and any new thread, computed on one thread (the engine is
    built with 3, not this machine's default, so the count seen is the builder's)."""
    eng = AsyncEngine(model=str(tiny_llama), kv_tier="memory://", num_threads=3, num_kv_blocks=64)
    read_checkpoint = eng.engine.read_checkpoint
    reads: list[int] = []

    def counted(*args):  # noqa: ANN002, ANN202
        reads.append(torch.get_num_threads())
        return read_checkpoint(*args)

    eng.engine.read_checkpoint = counted
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    prompt = list(range(3, 40))  # two full blocks of 16
    try:
        async for _ in eng.generate("saved", prompt, params):
            pass
        assert await asyncio.to_thread(eng.engine.connector.kv.flush, 30)
        assert await eng.reset_prefix_cache()  # the blocks now come from the tier alone
        async for _ in eng.generate("loaded", prompt, params):  # from the tier, on a loader thread
            pass
        assert eng.engine.connector.kv.stats().blocks_loaded == 2
        assert await asyncio.to_thread(torch.get_num_threads) == 3
        counts: list[int] = []
        thread = threading.Thread(target=lambda: counts.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert counts == [3]
        assert await eng.reload_weights() == 0
        assert reads == [3]
    finally:
        await eng.shutdown()
