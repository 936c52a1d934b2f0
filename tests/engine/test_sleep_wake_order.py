"""A ``wake_up`` sent while a ``sleep(mode="wait")`` still waits for running requests: the later call
wins. The sleep is cancelled (its caller gets ``SleepCancelledError``), the engine stays awake, and
the requests it held run.

As in test_engine_thread_races.py, hooks on the real objects force the interleaving (no sleeps to
hope for it): the running request cannot end before the sleep is queued behind it, and the wake-up
reaches the loop while the sleep still waits.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

import pytest

from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine, _Add
from engine.async_sleep import LoadWeightsCommand, SleepCommand, WakeUpCommand
from engine.errors import SleepCancelledError

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
PROMPT = list(range(3, 43))


@pytest.fixture(scope="module")
def offline(tiny_llama) -> dict[str, list[int]]:  # noqa: ANN001
    llm = LLM(str(tiny_llama), num_kv_blocks=64)
    return {
        "greedy": llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids,
        "long": llm.generate([PROMPT], LONG)[0].outputs[0].token_ids,
    }


@pytest.fixture
async def engine(tiny_llama):  # noqa: ANN001
    eng = AsyncEngine(model=str(tiny_llama), enable_sleep_mode=True, num_kv_blocks=64)
    yield eng
    await eng.shutdown()


@dataclass
class Gates:
    barrier_sent: threading.Event  # the sleep (or update) reached the command queue
    barrier_queued: threading.Event  # the loop queued it behind the running request
    add_sent: threading.Event  # a request was submitted after that
    wake_sent: threading.Event
    release: threading.Event  # set by the test's cleanup: nothing waits past it


def hold_until_wake(eng: AsyncEngine) -> Gates:
    """Hooks that force the race: the engine's model steps after the first wait until a barrier
    (a ``wait`` sleep or a weight update) is sent, so the running request is far from its end when
    the loop queues it; the loop then waits, right after queueing it, until a wake-up is sent. So
    the wake-up is applied while the barrier still waits for the request."""
    gates = Gates(*(threading.Event() for _ in range(5)))
    execute, submit, apply = eng.engine.model_runner.execute, eng._submit, eng._apply_lifecycle
    steps = 0

    def gated_execute(sched):  # noqa: ANN001, ANN202
        nonlocal steps
        steps += 1
        if steps > 1:
            assert gates.barrier_sent.wait(30) or gates.release.is_set()
        return execute(sched)

    def submit_and_tell(cmd) -> None:  # noqa: ANN001
        submit(cmd)
        if isinstance(cmd, SleepCommand | LoadWeightsCommand):
            gates.barrier_sent.set()
        elif isinstance(cmd, WakeUpCommand):
            gates.wake_sent.set()
        elif isinstance(cmd, _Add) and gates.barrier_queued.is_set():
            gates.add_sent.set()

    def apply_then_wait(cmd) -> None:  # noqa: ANN001
        apply(cmd)
        if not isinstance(cmd, WakeUpCommand) and cmd in eng._barriers:
            gates.barrier_queued.set()
            assert gates.wake_sent.wait(30) or gates.release.is_set()

    eng.engine.model_runner.execute = gated_execute
    eng._submit = submit_and_tell
    eng._apply_lifecycle = apply_then_wait
    return gates


async def collect(eng: AsyncEngine, rid: str, params: SamplingParams = GREEDY) -> tuple[list[int], str]:
    tokens: list[int] = []
    reason = None
    async for out in eng.generate(rid, PROMPT, params):
        tokens += out.outputs[0].token_ids
        reason = out.outputs[0].finish_reason
    return tokens, reason


async def running(eng: AsyncEngine) -> asyncio.Task:
    task = asyncio.ensure_future(collect(eng, "running", LONG))
    while eng.stats().num_running == 0:
        await asyncio.sleep(0.005)
    return task


async def test_a_wake_up_cancels_a_sleep_still_waiting_for_running_requests(engine, offline) -> None:
    """Before: the wake-up applied first (nothing to wake), then the sleep ran once the request
    ended, and the caller who woke the engine found it asleep, holding every new request."""
    gates = hold_until_wake(engine)
    try:
        busy = await running(engine)
        sleep = asyncio.ensure_future(engine.sleep(level=1, mode="wait"))
        assert await asyncio.to_thread(gates.barrier_queued.wait, 30)
        held = asyncio.ensure_future(collect(engine, "held"))  # sent while the sleep waits: held
        assert await asyncio.to_thread(gates.add_sent.wait, 30)
        await asyncio.wait_for(engine.wake_up(), 30)
        with pytest.raises(SleepCancelledError, match="cancelled by a wake_up"):
            await asyncio.wait_for(sleep, 30)
        assert not engine.is_sleeping()
        assert engine.stats().sleep_level == 0
        assert await asyncio.wait_for(busy, 60) == (offline["long"], "length")
        assert await asyncio.wait_for(held, 60) == (offline["greedy"], "length")
        assert await asyncio.wait_for(collect(engine, "after"), 60) == (offline["greedy"], "length")
        assert not engine.is_sleeping() and not engine._barriers and not engine._held
    finally:
        gates.release.set()


async def test_a_sleep_sent_after_the_wake_up_still_sleeps(engine, offline) -> None:
    """Only sleeps sent before the wake-up are cancelled: the order of the calls decides."""
    gates = hold_until_wake(engine)
    try:
        busy = await running(engine)
        first = asyncio.ensure_future(engine.sleep(level=1, mode="wait"))
        assert await asyncio.to_thread(gates.barrier_queued.wait, 30)
        await asyncio.wait_for(engine.wake_up(), 30)
        with pytest.raises(SleepCancelledError):
            await asyncio.wait_for(first, 30)
        await asyncio.wait_for(engine.sleep(level=2, mode="wait"), 60)  # runs once "running" ends
        assert engine.is_sleeping() and engine.stats().sleep_level == 2
        assert await asyncio.wait_for(busy, 60) == (offline["long"], "length")
        await asyncio.wait_for(engine.wake_up(), 60)
        assert await asyncio.wait_for(collect(engine, "after"), 60) == (offline["greedy"], "length")
    finally:
        gates.release.set()


async def test_a_wake_up_leaves_a_waiting_weight_update_to_run(engine, tiny_llama, offline) -> None:
    """A weight update waiting for running requests is not a sleep: a wake-up does not cancel it."""
    gates = hold_until_wake(engine)
    try:
        busy = await running(engine)
        update = asyncio.ensure_future(engine.reload_weights(str(tiny_llama)))
        assert await asyncio.to_thread(gates.barrier_queued.wait, 60)
        await asyncio.wait_for(engine.wake_up(), 30)
        assert await asyncio.wait_for(update, 60) == 0
        assert await asyncio.wait_for(busy, 60) == (offline["long"], "length")
        assert not engine.is_sleeping()
    finally:
        gates.release.set()
