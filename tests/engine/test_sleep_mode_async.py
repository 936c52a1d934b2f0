"""Sleep mode and weight updates on the async engine: what happens to requests in flight (vLLM's
abort / wait / keep), requests held while asleep, and updates that wait for running requests; and
vLLM's generation pause (``pause_generation`` / ``resume_generation``) with them."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine, EngineDeadError
from engine.demo import build_model
from engine.errors import SleepCancelledError

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
PROMPT = list(range(3, 43))


@pytest.fixture(scope="module")
def other_llama(models_root: Path) -> Path:
    return build_model(models_root / "sleep_other_llama", "llama", seed=101)


@pytest.fixture(scope="module")
def offline(tiny_llama: Path, other_llama: Path) -> dict[str, list[int]]:
    """Greedy tokens of fresh offline engines: GREEDY and LONG on tiny_llama, GREEDY on the other."""
    tiny = LLM(str(tiny_llama), num_kv_blocks=64)
    return {
        "greedy": tiny.generate([PROMPT], GREEDY)[0].outputs[0].token_ids,
        "long": tiny.generate([PROMPT], LONG)[0].outputs[0].token_ids,
        "other": LLM(str(other_llama), num_kv_blocks=64).generate([PROMPT], GREEDY)[0].outputs[0].token_ids,
    }


@pytest.fixture
async def engine(tiny_llama):
    eng = AsyncEngine(model=str(tiny_llama), enable_sleep_mode=True, num_kv_blocks=64)
    yield eng
    await eng.shutdown()


async def _collect(
    eng: AsyncEngine, rid: str, params: SamplingParams = GREEDY, started: asyncio.Event | None = None
):
    tokens: list[int] = []
    reason = None
    async for out in eng.generate(rid, PROMPT, params):
        tokens += out.outputs[0].token_ids
        reason = out.outputs[0].finish_reason
        if started is not None:
            started.set()
    return tokens, reason


async def _until_held(eng: AsyncEngine, count: int = 1) -> None:
    """Until ``count`` requests wait in the engine (taken in by its loop thread: at once, or late on
    a loaded machine); the bound only guards against a hang."""
    deadline = time.monotonic() + 60
    while eng.stats().num_waiting != count:
        assert time.monotonic() < deadline, eng.stats()
        await asyncio.sleep(0.01)


def _start(eng: AsyncEngine, rid: str, params: SamplingParams = GREEDY) -> tuple[asyncio.Task, asyncio.Event]:
    started = asyncio.Event()
    return asyncio.ensure_future(_collect(eng, rid, params, started)), started


async def test_abort_mode_ends_running_requests_and_holds_new_ones(engine, offline) -> None:
    running, started = _start(engine, "long", LONG)
    await started.wait()
    await engine.sleep(level=1)  # vLLM's default mode: abort
    tokens, reason = await running
    assert reason == "abort" and 0 < len(tokens) < 400
    assert engine.is_sleeping() and engine.stats().sleep_level == 1
    held = asyncio.ensure_future(_collect(engine, "held"))
    await _until_held(engine)
    assert not held.done()
    await engine.wake_up(["weights"])
    await asyncio.sleep(0.1)
    assert not held.done() and engine.is_sleeping()  # the KV cache is still asleep
    await engine.wake_up(["kv_cache"])
    assert await held == (offline["greedy"], "length")
    assert engine.stats().sleep_level == 0 and engine.is_healthy()


async def test_a_held_request_can_be_aborted(engine, offline) -> None:
    await engine.sleep(level=2)
    held = asyncio.ensure_future(_collect(engine, "held"))
    await _until_held(engine)
    await engine.abort("held")
    assert await held == ([], "abort")
    assert engine.stats().num_waiting == 0
    await engine.wake_up()
    assert await _collect(engine, "after") == (offline["greedy"], "length")


async def test_wait_mode_lets_running_requests_finish(engine, offline) -> None:
    running, started = _start(engine, "long", LONG)
    await started.wait()
    await engine.sleep(level=1, mode="wait")
    assert running.done() and running.result() == (offline["long"], "length")
    assert engine.is_sleeping()
    await engine.wake_up()
    assert await _collect(engine, "after") == (offline["greedy"], "length")


async def test_keep_mode_resumes_requests_with_the_same_tokens(engine, offline) -> None:
    running, started = _start(engine, "long", LONG)
    await started.wait()
    await engine.sleep(level=2, mode="keep")
    assert engine.engine.model_runner.model is None
    await asyncio.sleep(0.1)
    assert not running.done()
    await engine.wake_up()
    assert await running == (offline["long"], "length")  # recomputed: (seed, position) sampling


async def test_reload_waits_for_running_requests(engine, other_llama, offline) -> None:
    fingerprint = engine.model_info.model_fingerprint
    running, started = _start(engine, "long", LONG)
    await started.wait()
    assert await engine.reload_weights(str(other_llama)) == 0
    assert running.done() and running.result() == (offline["long"], "length")  # all on the old weights
    assert engine.model_info.model_fingerprint != fingerprint
    assert await _collect(engine, "after") == (offline["other"], "length")


async def test_reload_can_abort_running_requests(engine, other_llama, offline) -> None:
    running, started = _start(engine, "long", LONG)
    await started.wait()
    assert await engine.reload_weights(str(other_llama), abort_running=True) == 1
    assert (await running)[1] == "abort"
    assert await _collect(engine, "after") == (offline["other"], "length")


async def test_bad_commands_leave_the_engine_serving(engine, tiny_qwen3, offline) -> None:
    with pytest.raises(ValueError, match="sleep level"):
        await engine.sleep(level=3)
    with pytest.raises(ValueError, match="sleep mode"):
        await engine.sleep(level=1, mode="later")
    with pytest.raises(ValueError, match="tag"):
        await engine.wake_up(["gpu"])
    with pytest.raises(ValueError, match="architecture"):
        await engine.reload_weights(str(tiny_qwen3))
    assert not engine.is_sleeping() and engine.is_healthy()
    assert await _collect(engine, "after") == (offline["greedy"], "length")


async def test_sleep_needs_sleep_mode(tiny_llama) -> None:
    eng = AsyncEngine(model=str(tiny_llama), num_kv_blocks=64)
    try:
        with pytest.raises(ValueError, match="--enable-sleep-mode"):
            await eng.sleep()
    finally:
        await eng.shutdown()


async def test_shutdown_while_asleep_fails_held_requests_cleanly(tiny_llama) -> None:
    eng = AsyncEngine(model=str(tiny_llama), enable_sleep_mode=True, num_kv_blocks=64)
    await eng.sleep(level=1)
    held = asyncio.ensure_future(_collect(eng, "held"))
    await _until_held(eng)
    await eng.shutdown()
    with pytest.raises(EngineDeadError):
        await held
    with pytest.raises(EngineDeadError):
        await eng.wake_up()


# -- vLLM's pause_generation / resume_generation (the weight syncs of RL trainers) ----------------


async def test_pause_wait_lets_running_requests_finish_and_holds_new_ones(engine, offline) -> None:
    running, started = _start(engine, "long", LONG)
    await started.wait()
    await engine.pause_generation(mode="wait")
    assert running.done() and running.result() == (offline["long"], "length")
    assert engine.is_paused() and engine.stats().paused and not engine.is_sleeping()
    held = asyncio.ensure_future(_collect(engine, "held"))
    await _until_held(engine)
    await asyncio.sleep(0.05)
    assert not held.done()
    await engine.resume_generation()
    assert await held == (offline["greedy"], "length")
    assert not engine.is_paused()


async def test_a_resume_cancels_a_waiting_pause(engine, offline) -> None:
    running, started = _start(engine, "long", LONG)
    await started.wait()
    pause = asyncio.ensure_future(engine.pause_generation(mode="wait"))
    while not engine.stats().paused:  # the pause reached the loop and waits for the request
        await asyncio.sleep(0.005)
    await engine.resume_generation()
    with pytest.raises(SleepCancelledError, match="cancelled by a resume"):
        await pause
    assert not engine.is_paused()
    assert await running == (offline["long"], "length")


async def test_keep_pause_freezes_and_a_weight_update_preempts_the_frozen(
    engine, other_llama, offline
) -> None:
    running, started = _start(engine, "long", LONG)
    await started.wait()
    await engine.pause_generation(mode="keep")
    scheduler = engine.engine.scheduler
    frozen = scheduler.running[0]
    computed = frozen.num_computed_tokens
    await asyncio.sleep(0.05)
    assert frozen.num_computed_tokens == computed and not running.done()  # nothing steps
    # The update does not wait for the frozen request (it would never end): it is preempted, to be
    # recomputed on the new weights, which never meet the old weights' KV.
    assert await engine.reload_weights(str(other_llama)) == 0
    assert scheduler.running == [] and frozen.num_computed_tokens == 0
    assert engine.is_paused()
    await engine.resume_generation()
    tokens, reason = await running
    generated = computed - len(PROMPT) + 1  # the tokens sampled before the pause
    assert reason == "length" and len(tokens) == 400
    assert tokens[:generated] == offline["long"][:generated]
    assert await _collect(engine, "after") == (offline["other"], "length")


async def test_pause_modes_are_checked_and_need_no_sleep_mode(tiny_llama) -> None:
    eng = AsyncEngine(model=str(tiny_llama), num_kv_blocks=64)
    try:
        with pytest.raises(ValueError, match="mode must be one of"):
            await eng.pause_generation(mode="later")
        assert not eng.is_paused()
        await eng.pause_generation()
        assert eng.is_paused() and eng.stats().paused
        await eng.resume_generation()
        assert not eng.is_paused()
    finally:
        await eng.shutdown()
