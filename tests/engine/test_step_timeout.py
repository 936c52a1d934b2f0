"""An engine step that runs over ``step_timeout_s`` (a hung kernel, a deadlock) makes the engine
unhealthy until it ends, and the log says where the loop thread is."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from engine import SamplingParams
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def wedge_the_next_step(engine: AsyncEngine) -> tuple[threading.Event, threading.Event]:
    """(entered, release): the next step that samples blocks until ``release`` is set."""
    entered, release = threading.Event(), threading.Event()

    def hang_here(request_ids, logits) -> None:  # noqa: ANN001 - the engine's logits hook
        entered.set()
        release.wait(60)

    engine.engine.logits_observers.append(hang_here)
    return entered, release


async def _wait_for(condition, timeout: float = 60.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout  # a hang guard only
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_a_stuck_step_is_unhealthy_until_it_ends(tiny_llama, caplog: pytest.LogCaptureFixture) -> None:
    engine = AsyncEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=64, step_timeout_s=1.5))
    try:
        entered, release = wedge_the_next_step(engine)

        async def run() -> list[int]:
            tokens: list[int] = []
            async for out in engine.generate("r", [5, 6, 7, 8], GREEDY):
                tokens += out.outputs[0].token_ids
            return tokens

        with caplog.at_level(logging.WARNING, logger="engine.async_engine"):
            submitted = time.monotonic()
            task = asyncio.ensure_future(run())
            await _wait_for(entered.is_set)
            # Within the timeout: a long step, not a stuck one (read later than that, on a loaded
            # machine, the step may be past it: then no verdict).
            assert engine.is_healthy() or time.monotonic() - submitted >= 1.5
            await _wait_for(lambda: not engine.is_healthy())
            stuck = [r.getMessage() for r in caplog.records if "has run for over 1.5 s" in r.getMessage()]
            assert len(stuck) == 1 and "in hang_here" in stuck[0]  # where the loop thread waits
            assert not engine.is_healthy()  # logged once
            release.set()
            assert len(await asyncio.wait_for(task, 60)) == 4  # the request was not lost
            assert engine.is_healthy()
        assert any("the stuck engine step ended" in r.getMessage() for r in caplog.records)
    finally:
        release.set()
        await engine.shutdown()


async def test_zero_turns_the_check_off(tiny_llama) -> None:
    engine = AsyncEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=64, step_timeout_s=0))
    entered, release = wedge_the_next_step(engine)
    try:
        task = asyncio.ensure_future(_drain(engine))
        await _wait_for(entered.is_set)
        await asyncio.sleep(0.3)
        assert engine.is_healthy()
        release.set()
        await asyncio.wait_for(task, 60)
    finally:
        release.set()
        await engine.shutdown()


async def _drain(engine: AsyncEngine) -> None:
    async for _ in engine.generate("r", [5, 6, 7, 8], GREEDY):
        pass


@pytest.mark.parametrize("bad", [-1, "5", True, float("nan")])
def test_a_bad_timeout_is_refused(bad) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="step_timeout_s must be a number of seconds >= 0"):
        EngineConfig(model="x", step_timeout_s=bad)
