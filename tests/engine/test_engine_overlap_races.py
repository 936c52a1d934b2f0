"""Overlapping changes from two clients of one ``AsyncEngine``: an adapter removed or reloaded during a
request's read of it, a wake-up sent while a sleep is queued.

As in test_engine_thread_races.py, each test forces its interleaving with a hook on a method of the
real object (no sleeps to hope for it), so it fails every time the race is open.
"""

from __future__ import annotations

import asyncio
import threading

from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine
from engine.async_sleep import WakeUpCommand
from engine.config import EngineConfig
from engine.lora_request import LoRARequest

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT = [5, 6, 7, 8]


async def _drain(stream) -> list[int]:  # noqa: ANN001
    tokens: list[int] = []
    async for out in stream:
        tokens += out.outputs[0].token_ids
    return tokens


def _adapter_read_held(eng: AsyncEngine, tiny_llama, tmp_path):  # noqa: ANN001, ANN202
    """Adapter "a" (files at the returned path) evicted by "other" (``max_cpu_loras=1``), and the
    engine's ``read_lora`` hooked so that the first read off the main thread (a request's) is held
    once done: ``old_read`` is set then, and it returns when ``release`` is set. Also returns the
    real ``read_lora``."""
    from engine.demo import build_lora_adapter

    path = build_lora_adapter(tmp_path / "a", tiny_llama, seed=1)
    a, other = LoRARequest("a", 1, str(path)), LoRARequest("other", 2, str(path))
    read_lora = eng.engine.read_lora
    old_read, release = threading.Event(), threading.Event()

    def read_then_wait(request: LoRARequest):  # noqa: ANN202
        adapter = read_lora(request)
        if threading.current_thread() is not threading.main_thread() and not old_read.is_set():
            old_read.set()  # the request's read (of the old files) is done: hold it there
            release.wait(30)
        return adapter

    return path, a, other, read_lora, read_then_wait, old_read, release


def _lora_engine(tiny_llama) -> AsyncEngine:  # noqa: ANN001
    return AsyncEngine(
        EngineConfig(model=str(tiny_llama), num_kv_blocks=128, enable_lora=True, max_cpu_loras=1)
    )


async def test_an_adapter_removed_during_a_requests_read_is_read_again_when_added(
    tiny_llama, tmp_path
) -> None:
    """A request naming an adapter that is not loaded reads its files in a worker thread, then keeps
    what it read loaded. A ``remove_lora`` during that read was undone by it: the adapter was loaded
    again after the removal, and a later ``add_lora`` of that name and directory (no ``reload``: a
    removal unloaded it, so its files are read again) served the weights read before the removal,
    not the files now there."""
    from engine.demo import build_lora_adapter

    eng = _lora_engine(tiny_llama)
    path, a, other, read_lora, read_then_wait, old_read, release = _adapter_read_held(
        eng, tiny_llama, tmp_path
    )

    try:
        old = await eng.add_lora(a)
        await eng.add_lora(other)  # one adapter kept loaded: "a" is evicted
        eng.engine.read_lora = read_then_wait
        request = asyncio.ensure_future(_drain(eng.generate("r", PROMPT, GREEDY, lora_request=a)))
        await asyncio.to_thread(old_read.wait, 30)
        assert await eng.remove_lora("a")
        build_lora_adapter(path, tiny_llama, seed=2)  # new weights, same directory
        new_id = read_lora(a).weights_id
        assert new_id != old.weights_id
        release.set()
        assert len(await asyncio.wait_for(request, 30)) == GREEDY.max_tokens  # the request ran
        added = await eng.add_lora(a)
        assert added is not None and added.weights_id == new_id
        assert eng.engine.cached_lora(a).weights_id == new_id
    finally:
        release.set()
        await eng.shutdown()


async def test_a_wake_up_sent_while_a_sleep_is_queued_reads_the_checkpoint_off_the_loop(tiny_llama) -> None:
    """``wake_up`` read discarded weights in a worker thread only if they were discarded when it was
    called. With a ``sleep(level=2)`` queued but not yet run (another client's), it sent no
    checkpoint; the sleep discarded the weights and the engine loop's thread then read the whole
    checkpoint itself, answering nothing (aborts, stats, shutdown) meanwhile."""
    expected = LLM(str(tiny_llama), num_kv_blocks=64).generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    eng = AsyncEngine(model=str(tiny_llama), enable_sleep_mode=True, num_kv_blocks=64)
    sleep, submit, read_checkpoint = eng.engine.sleep, eng._submit, eng.engine.read_checkpoint
    sleeping, wake_sent = threading.Event(), threading.Event()
    readers: list[threading.Thread] = []

    def sleep_once_the_wake_is_sent(level: int) -> None:
        sleeping.set()  # the sleep is on the loop, not run yet
        wake_sent.wait(60)
        sleep(level)

    def submit_and_tell(cmd) -> None:  # noqa: ANN001
        submit(cmd)
        if isinstance(cmd, WakeUpCommand):
            wake_sent.set()

    def read_and_record(*args):  # noqa: ANN002, ANN202
        readers.append(threading.current_thread())
        return read_checkpoint(*args)

    eng.engine.sleep = sleep_once_the_wake_is_sent
    eng._submit = submit_and_tell
    eng.engine.read_checkpoint = read_and_record
    try:
        asleep = asyncio.ensure_future(eng.sleep(level=2))
        await asyncio.to_thread(sleeping.wait, 60)
        await asyncio.wait_for(eng.wake_up(), 30)
        await asyncio.wait_for(asleep, 30)
        assert wake_sent.is_set()
        assert readers and eng._thread not in readers
        assert not eng.is_sleeping()
        assert await asyncio.wait_for(_drain(eng.generate("r", PROMPT, GREEDY)), 30) == expected
    finally:
        wake_sent.set()
        await eng.shutdown()


async def test_a_reload_is_not_undone_by_a_requests_read_of_the_old_files(tiny_llama, tmp_path) -> None:
    """A request naming an adapter that is not loaded reads its files in a worker thread, then
    keeps what it read loaded. A ``reload`` of that adapter (new files in the same directory)
    finishing during the read was undone by it: the engine went on running the old weights while
    ``served_loras`` (``/v1/models``) named the new ones."""
    from engine.demo import build_lora_adapter

    eng = _lora_engine(tiny_llama)
    path, a, other, read_lora, read_then_wait, old_read, release = _adapter_read_held(
        eng, tiny_llama, tmp_path
    )

    try:
        await eng.add_lora(a)
        await eng.add_lora(other)  # one adapter kept loaded: "a" is evicted
        eng.engine.read_lora = read_then_wait
        request = asyncio.ensure_future(_drain(eng.generate("r", [5, 6, 7], GREEDY, lora_request=a)))
        await asyncio.to_thread(old_read.wait, 30)
        build_lora_adapter(path, tiny_llama, seed=2)  # new weights, same directory
        eng.engine.read_lora = read_lora
        reloaded = await eng.add_lora(a, reload=True)
        release.set()
        await asyncio.wait_for(request, 30)
        assert eng.served_loras["a"] is reloaded
        assert eng.engine.cached_lora(a).weights_id == reloaded.weights_id
    finally:
        release.set()
        await eng.shutdown()
