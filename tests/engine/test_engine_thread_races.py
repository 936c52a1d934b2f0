"""Races between the API's threads (event loop, worker threads) and the engine loop's thread.

Each test forces one interleaving with a hook on a method of the real object (no sleeps to
hope for it), so it fails every time the race is open and passes every time it is closed.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine import SamplingParams
from engine.async_engine import AsyncEngine, EngineDeadError
from engine.config import EngineConfig
from engine.tokenizer import Tokenizer

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ENDLESS = SamplingParams(temperature=0.0, ignore_eos=True)  # as many tokens as fit


@pytest.fixture
async def engine(tiny_llama):
    eng = AsyncEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=128))
    yield eng
    await eng.shutdown()


def _crash_switch(eng: AsyncEngine) -> threading.Event:
    """An event that makes the engine's model step fail (a device failure), as a crash does.

    The first step runs; every later one waits in the model until the event is set and then fails.
    So the request started by ``_running`` is still running whenever the switch is thrown, however
    slow the machine (left to run, it ends at the model's length, and a loop with nothing to step
    never reaches the failing model)."""
    crash = threading.Event()
    execute = eng.engine.model_runner.execute
    steps = 0

    def failing_execute(sched):  # noqa: ANN001, ANN202
        nonlocal steps
        steps += 1
        if steps > 1:
            crash.wait(120)
            raise RuntimeError("simulated device failure")
        return execute(sched)

    eng.engine.model_runner.execute = failing_execute
    return crash


async def _running(eng: AsyncEngine, prompt: list[int]) -> asyncio.Future:
    """A request running on the loop (it runs until the loop dies)."""
    running = asyncio.ensure_future(_drain(eng.generate("bg", prompt, ENDLESS)))
    while eng.stats().num_running == 0:
        await asyncio.sleep(0.005)
    return running


async def _drain(stream) -> None:  # noqa: ANN001
    async for _ in stream:
        pass


def _kill_loop(eng: AsyncEngine, crash: threading.Event) -> None:
    """Crash the loop at its next step and wait until its thread has ended."""
    crash.set()
    eng._thread.join(60)
    assert not eng._thread.is_alive()


async def test_a_request_submitted_as_the_loop_dies_fails_instead_of_hanging(engine, prompts) -> None:
    """``start`` checks the loop is alive, builds the request (tokenizing, validating: long for a
    long prompt), then queues it. A loop that crashed in between had already failed every stream and
    command it knew of: the new one was queued to a dead loop and its caller waited forever."""
    crash = _crash_switch(engine)
    running = await _running(engine, prompts[0])
    make_request = engine.engine.make_request

    def make_request_as_the_loop_dies(request_id, *args, **kwargs):  # noqa: ANN001, ANN202
        req = make_request(request_id, *args, **kwargs)
        _kill_loop(engine, crash)  # after start's liveness check, before the request is queued
        return req

    engine.engine.make_request = make_request_as_the_loop_dies
    with pytest.raises(EngineDeadError, match="simulated device failure"):
        await asyncio.wait_for(_drain(engine.generate("late", prompts[1], GREEDY)), 60)
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(running, 60)
    assert "late" not in engine._streams


async def test_a_weight_update_read_while_the_loop_dies_fails_instead_of_hanging(engine, prompts) -> None:
    """``reload_weights`` reads the checkpoint in a worker thread (seconds for a real model) and
    then queues the install; a loop that crashed during the read never resolved it."""
    crash = _crash_switch(engine)
    running = await _running(engine, prompts[0])
    read_checkpoint = engine.engine.read_checkpoint

    def read_while_the_loop_dies(*args):  # noqa: ANN002, ANN202
        checkpoint = read_checkpoint(*args)
        _kill_loop(engine, crash)
        return checkpoint

    engine.engine.read_checkpoint = read_while_the_loop_dies
    with pytest.raises(EngineDeadError, match="simulated device failure"):
        await asyncio.wait_for(engine.reload_weights(), 60)
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(running, 60)
    # Nothing to abort or cancel on a dead loop: neither raises, neither hangs.
    await asyncio.wait_for(engine.abort("bg"), 60)
    engine.cancel("bg")


class _MeetingDict(dict):
    """The compiled-template cache, instrumented: a removal waits (up to a bound) for a second
    removal, so two threads that both evict do it at the same moment."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.meet = threading.Barrier(2)

    def __delitem__(self, key) -> None:  # noqa: ANN001
        try:
            self.meet.wait(timeout=2)
        except threading.BrokenBarrierError:
            pass  # evictions that take turns never meet
        super().__delitem__(key)


def test_chat_templates_compiled_on_two_threads_at_once_both_render(tiny_llama) -> None:
    """The event loop renders short chat prompts and worker threads long ones
    (``server.serving_common.plan_off_loop``), all through the engine's one ``Tokenizer``. With the
    cache of compiled templates full, two threads compiling requests' own templates both chose the
    same oldest entry to evict: one evicted it, the other's removal raised KeyError (a 500)."""
    from engine.chat_template import MAX_COMPILED

    templates = Tokenizer.from_dir(tiny_llama)._chat_templates
    messages = [{"role": "user", "content": "hi"}]
    for i in range(MAX_COMPILED):  # fill the cache with requests' own templates
        templates.render(messages, chat_template=f"{{{{ messages[0].content }}}} {i}")
    templates._compiled = _MeetingDict(templates._compiled)
    results: dict[int, object] = {}

    def render(i: int) -> None:
        try:
            results[i] = templates.render(messages, chat_template=f"{{{{ messages[0].content }}}} new {i}")
        except Exception as e:  # noqa: BLE001 - what the test reports
            results[i] = e

    threads = [threading.Thread(target=render, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == {0: "hi new 0", 1: "hi new 1"}
    assert len(templates._compiled) == MAX_COMPILED
