"""AsyncEngine: concurrent streams equal the offline API; abort, disconnect, crash, resume."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine, EngineDeadError
from engine.config import EngineConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# A burst wait that must not end a test's gathering (an hour: a hang), and the bound that tells it
# from a wait ended by what the test checks, however loaded the machine.
HANG_S = 3600.0
WAIT_S = 120.0


@pytest.fixture
async def engine(tiny_llama):
    eng = AsyncEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=128))
    yield eng
    await eng.shutdown()


async def _collect(eng: AsyncEngine, rid: str, prompt, params, **kw):
    tokens: list[int] = []
    text = ""
    last = None
    async for out in eng.generate(rid, prompt, params, **kw):
        tokens += out.outputs[0].token_ids
        text += out.outputs[0].text
        last = out
    return tokens, text, last


async def _wait_idle(eng: AsyncEngine) -> None:
    def idle() -> bool:
        s = eng.stats()
        return s.num_running == 0 and s.num_waiting == 0 and s.kv_cache_usage == 0.0

    await _until(eng, idle, "engine not idle")


async def _until(eng: AsyncEngine, condition, what: str) -> None:
    """Wait for ``condition`` (the engine thread's pace, not a sleep's); the bound guards a hang."""
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, f"{what}: {eng.stats()}"
        await asyncio.sleep(0.01)


async def test_concurrent_streams_equal_offline_generate(engine, tiny_llama, prompts) -> None:
    ref = LLM(str(tiny_llama), num_kv_blocks=128).generate(prompts, GREEDY)
    results = await asyncio.gather(*(_collect(engine, f"r{i}", p, GREEDY) for i, p in enumerate(prompts)))
    for (tokens, text, last), r in zip(results, ref, strict=True):
        assert tokens == r.outputs[0].token_ids
        assert text == r.outputs[0].text
        assert last.finished and last.outputs[0].finish_reason == "length"
        m = last.metrics
        assert m["arrival_time"] <= m["first_scheduled_time"] <= m["first_token_time"] <= m["finished_time"]
    stats = engine.stats()
    assert stats.generation_tokens == 12 * len(prompts)
    assert stats.prompt_tokens == sum(len(p) for p in prompts)
    assert engine.is_healthy()


async def test_abort_frees_blocks_and_ends_stream(engine, prompts) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=700, ignore_eos=True)
    outs = []

    async def consume():
        async for out in engine.generate("long", prompts[-1], params):
            outs.append(out)

    task = asyncio.create_task(consume())
    while not outs and not task.done():
        await asyncio.sleep(0.01)
    assert engine.stats().kv_cache_usage > 0
    await engine.abort("long")
    # Blocks are free as soon as abort returns.
    s = engine.stats()
    assert (s.num_running, s.num_waiting, s.kv_cache_usage) == (0, 0, 0.0)
    await asyncio.wait_for(task, 60)
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    engine.engine.block_manager.check_integrity()


async def test_closing_the_stream_aborts(engine, prompts) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=700, ignore_eos=True)
    gen = engine.generate("gone", prompts[-2], params)
    await gen.__anext__()
    await gen.aclose()  # what a client disconnect does
    await _wait_idle(engine)


async def test_start_hands_each_output_to_its_sink_as_generate_streams_them(
    engine, tiny_llama, prompts
) -> None:
    ref = LLM(str(tiny_llama), num_kv_blocks=128).generate(prompts[:3], GREEDY)
    got: dict[str, list] = {f"s{i}": [] for i in range(3)}
    done = asyncio.Event()

    def sink_of(rid: str):
        def sink(out) -> None:
            got[rid].append(out)
            if all(outs and outs[-1].finished for outs in got.values()):
                done.set()

        return sink

    for i, p in enumerate(prompts[:3]):
        engine.start(f"s{i}", p, GREEDY, sink_of(f"s{i}"))
    await asyncio.wait_for(done.wait(), 60)
    for i, r in enumerate(ref):
        outs = got[f"s{i}"]
        assert [t for o in outs for t in o.outputs[0].token_ids] == r.outputs[0].token_ids
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert engine._streams == {}  # a finished request's stream is dropped on its final output


async def test_start_refuses_bad_input_before_submitting(engine) -> None:
    with pytest.raises(ValueError, match="vocabulary"):
        engine.start("bad", [10**7], GREEDY, lambda out: None)
    assert "bad" not in engine._streams
    engine.start("dup", [1, 2, 3], GREEDY, lambda out: None)
    with pytest.raises(ValueError, match="already in use"):
        engine.start("dup", [1, 2, 3], GREEDY, lambda out: None)
    await _wait_idle(engine)


async def test_cancel_stops_the_sink_and_frees_the_blocks(engine, prompts) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=700, ignore_eos=True)
    outs: list = []
    engine.start("long", prompts[-1], params, outs.append)
    while not outs:
        await asyncio.sleep(0.01)
    engine.cancel("long")
    seen = len(outs)
    await _wait_idle(engine)
    await asyncio.sleep(0.05)
    assert len(outs) == seen and not outs[-1].finished  # nothing after cancel, not even the abort
    engine.cancel("long")  # a second cancel, or one of a finished request, does nothing
    engine.engine.block_manager.check_integrity()


async def test_a_reused_id_after_cancel_runs_only_the_new_request(engine, prompts) -> None:
    """start, cancel and start again with the same id before the loop thread took any of it in:
    the first request must not run, nor end the second's stream with its abort."""
    first: list = []
    second: list = []
    done = asyncio.Event()

    def on_second(out) -> None:
        second.append(out)
        if out.finished:
            done.set()

    with engine._wake:  # hold the loop thread off the command queue
        engine.start("same", prompts[0], GREEDY, first.append)
        engine.cancel("same")
        engine.start("same", prompts[1], GREEDY, on_second)
    await asyncio.wait_for(done.wait(), 60)
    assert first == []
    assert second[-1].outputs[0].finish_reason == "length"
    assert sum(len(o.outputs[0].token_ids) for o in second) == 12
    assert second[-1].prompt_token_ids == prompts[1]
    assert engine.stats().prompt_tokens == len(prompts[1])  # the first never ran a step


async def test_a_failing_sink_does_not_starve_the_others(engine, prompts) -> None:
    outs: list = []
    done = asyncio.Event()

    def broken(out) -> None:
        raise RuntimeError("a consumer's bug")

    def good(out) -> None:
        outs.append(out)
        if out.finished:
            done.set()

    engine.start("broken", prompts[0], GREEDY, broken)
    engine.start("good", prompts[1], GREEDY, good)
    await asyncio.wait_for(done.wait(), 60)
    assert sum(len(o.outputs[0].token_ids) for o in outs) == 12
    assert engine.is_healthy()


async def test_validation_errors(engine) -> None:
    with pytest.raises(ValueError, match="empty"):
        await _collect(engine, "e1", [], GREEDY)
    with pytest.raises(ValueError, match="max_model_len"):
        await _collect(engine, "e2", [1, 2], SamplingParams(max_tokens=10**6))
    with pytest.raises(ValueError, match="vocabulary"):
        await _collect(engine, "e3", [10**7], GREEDY)
    assert engine.is_healthy()


async def test_resume_continues_at_the_same_positions(engine, prompts) -> None:
    full, _, _ = await _collect(engine, "full", prompts[6], GREEDY)
    sampled = SamplingParams(temperature=1.0, seed=9, max_tokens=12, ignore_eos=True)
    full_s, _, _ = await _collect(engine, "full_s", prompts[6], sampled)
    resumed, _, last = await _collect(engine, "res", prompts[6], GREEDY, resume_token_ids=full[:4])
    assert resumed == full[4:]  # max_tokens counts the resumed tokens
    res_s, _, _ = await _collect(engine, "res_s", prompts[6], sampled, resume_token_ids=full_s[:5])
    assert res_s == full_s[5:]


async def test_kv_transfer_reports_block_hashes(engine, prompts) -> None:
    from kvcache.keys import block_hashes, to_hex

    params = SamplingParams(temperature=0.0, max_tokens=1)
    _, _, last = await _collect(engine, "prod", prompts[7], params, kv_transfer={"role": "producer"})
    assert last.kv_transfer["block_hashes"] == to_hex(block_hashes(prompts[7], 16))
    assert last.kv_transfer["num_cached_tokens"] == 0


async def test_loop_crash_fails_requests_and_marks_unhealthy(engine, prompts) -> None:
    def boom(_out):
        raise RuntimeError("simulated device failure")

    engine.engine.model_runner.execute = boom
    with pytest.raises(EngineDeadError, match="simulated device failure"):
        await asyncio.wait_for(_collect(engine, "x", prompts[2], GREEDY), 60)
    assert not engine.is_healthy()
    with pytest.raises(EngineDeadError):
        await _collect(engine, "y", prompts[2], GREEDY)


async def test_reset_prefix_cache(engine, prompts) -> None:
    await _collect(engine, "warm", prompts[-1], GREEDY)
    cached = engine.engine.block_manager.num_cached_blocks
    # 211 tokens with KV: 13 full blocks and the 3 tokens of a cached partial block.
    assert cached == (200 + 11) // 16 + 1 and engine.engine.block_manager.num_partial_blocks == 1
    assert await engine.reset_prefix_cache() == cached
    assert engine.engine.block_manager.num_cached_blocks == 0
    assert engine.engine.block_manager.num_partial_blocks == 0
    params = SamplingParams(temperature=0.0, max_tokens=700, ignore_eos=True)
    gen = engine.generate("busy", prompts[-2], params)
    await gen.__anext__()
    assert await engine.reset_prefix_cache() is False  # refused while a request runs
    await gen.aclose()
    await _wait_idle(engine)


# -- an idle loop gathers a burst before its first step -------------------------------------------------


def _same_first_step(first: dict, other: dict) -> bool:
    """``other`` was scheduled in the step that gave ``first`` its first token."""
    return other["first_scheduled_time"] <= first["first_token_time"]


async def test_idle_loop_gathers_requests_submitted_over_several_loop_passes(engine, prompts) -> None:
    # The first request is submitted, then the event loop is busy for 20 ms (as parsing the rest of a
    # burst keeps it) before submitting two more. Started at once, the engine thread would step the
    # first alone meanwhile; its probe through the loop brings the other two into the first step.
    engine.arrival_wait_s = HANG_S  # the probe, not the cap, must end the wait
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    first = asyncio.ensure_future(_collect(engine, "g0", prompts[0], params))

    async def busy_then_more():
        time.sleep(0.02)  # noqa: ASYNC251 - holding the loop is the point
        return await asyncio.gather(*(_collect(engine, f"g{i}", prompts[i], params) for i in (1, 2)))

    (_, _, a), rest = await asyncio.wait_for(asyncio.gather(first, busy_then_more()), WAIT_S)
    for _, _, later in rest:
        assert _same_first_step(a.metrics, later.metrics)


async def test_idle_loop_waits_for_announced_requests(engine, prompts) -> None:
    engine.arrival_wait_s = HANG_S
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    submitted = engine.announce()  # a request being parsed while the first one is submitted
    assert engine.announced == 1
    first = asyncio.ensure_future(_collect(engine, "a0", prompts[0], params))
    await asyncio.sleep(0.05)  # the engine would have stepped "a0" alone by now
    assert not first.done()
    second = asyncio.ensure_future(_collect(engine, "a1", prompts[1], params))
    await asyncio.sleep(0)  # "a1" submitted...
    submitted()  # ...and so marked
    submitted()  # idempotent
    assert engine.announced == 0
    (_, _, a), (_, _, b) = await asyncio.wait_for(asyncio.gather(first, second), WAIT_S)
    assert _same_first_step(a.metrics, b.metrics)


async def test_a_round_that_only_brought_the_announced_requests_is_the_last(engine, prompts) -> None:
    """Requests announced before a round's probe left are what the round waits for, not news of
    more coming: the burst takes one probe round (a second one would only add a round trip through
    every submitter before the first step). A request announced during the round takes another."""
    engine.arrival_wait_s = HANG_S
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    marks = {i: engine.announce() for i in range(3)}  # three requests being parsed

    async def submit(*ids: int) -> list[asyncio.Future]:
        tasks = [asyncio.ensure_future(_collect(engine, f"b{i}", prompts[i], params)) for i in ids]
        await asyncio.sleep(0)  # each task submits its request in its first step
        for i in ids:
            marks[i]()
        return tasks

    probes = engine._probes_sent
    tasks = await submit(0)
    await _until(engine, lambda: engine._probes_back == probes + 1, "no probe came back")
    # The round's probe is back; it waits for the two announced.
    assert not tasks[0].done() and engine.announced == 2
    tasks += await submit(1, 2)
    results = await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S)
    assert engine._probes_sent == probes + 1
    assert all(_same_first_step(results[0][2].metrics, r[2].metrics) for r in results[1:])

    await _wait_idle(engine)
    marks = {0: engine.announce()}
    probes = engine._probes_sent
    tasks = [asyncio.ensure_future(_collect(engine, "c0", prompts[3], params))]
    # Round one's probe is back (however slow the engine thread was to start it): it waits for the
    # announced request...
    await _until(engine, lambda: engine._probes_back == probes + 1, "no probe came back")
    marks[1] = engine.announce()  # ...and another arrives meanwhile
    tasks += [asyncio.ensure_future(_collect(engine, f"c{i}", prompts[3 + i], params)) for i in (1, 2)]
    await asyncio.sleep(0)
    marks[0](), marks[1]()
    results = await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S)
    assert engine._probes_sent == probes + 2
    assert all(_same_first_step(results[0][2].metrics, r[2].metrics) for r in results[1:])


async def test_requests_added_while_the_loop_gathers_do_not_wake_it(engine, prompts) -> None:
    """The gathering loop thread waits for probes and announced requests; waking it for each add of
    a burst would hand the GIL to it and back once per request on the submitter's loop."""
    engine.arrival_wait_s = HANG_S
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    held = engine.announce()
    first = asyncio.ensure_future(_collect(engine, "n0", prompts[0], params))
    # The loop thread starts gathering (at once here; late on a loaded machine).
    await _until(engine, lambda: engine._gathering, "the loop never gathered")
    assert not first.done()
    wakes = 0
    notify = engine._wake.notify

    def counted(n: int = 1) -> None:
        nonlocal wakes
        wakes += 1
        notify(n)

    engine._wake.notify = counted
    try:
        rest = [asyncio.ensure_future(_collect(engine, f"n{i}", prompts[i], params)) for i in (1, 2, 3)]
        await asyncio.sleep(0)  # all three submitted
        assert engine._num_adds >= 4 and wakes == 0
        held()  # the announced request: the rounds end (one more, for the three unannounced)
        results = await asyncio.wait_for(asyncio.gather(first, *rest), WAIT_S)
        assert wakes == 1  # the burst is in: that one woke it
    finally:
        engine._wake.notify = notify
    assert all(_same_first_step(results[0][2].metrics, r[2].metrics) for r in results[1:])


async def test_burst_wait_ms_0_starts_on_the_first_arrival(engine, tiny_llama, prompts) -> None:
    """``burst_wait_ms=0``: an idle loop steps the first request at once, never probing for more
    (an announced request that never comes would otherwise hold it until the cap); the default
    probes."""
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    await _collect(engine, "p0", prompts[0], params)
    assert engine.arrival_wait_s == 0.025 and engine._probes_sent >= 1
    eager = AsyncEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=128, burst_wait_ms=0))
    try:
        assert eager.arrival_wait_s == 0
        forgotten = eager.announce()
        _, _, out = await asyncio.wait_for(_collect(eager, "e0", prompts[0], params), WAIT_S)
        assert out.finished and eager._probes_sent == 0
        forgotten()
    finally:
        await eager.shutdown()


async def test_announced_wait_is_capped_and_a_lone_request_does_not_wait(engine, prompts) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.arrival_wait_s = 0.2
    forgotten = engine.announce()  # never submitted: the wait ends at the cap
    _, _, out = await asyncio.wait_for(_collect(engine, "capped", prompts[0], params), WAIT_S)
    waited = out.metrics["first_scheduled_time"] - out.metrics["arrival_time"]
    assert 0.2 <= waited < 60  # the cap ended it: the announced request never comes
    forgotten()
    engine.arrival_wait_s = HANG_S  # nothing announced: a lone request starts at once
    _, _, out = await asyncio.wait_for(_collect(engine, "lone", prompts[1], params), WAIT_S)
    assert out.metrics["first_scheduled_time"] - out.metrics["arrival_time"] < 60


async def test_a_finished_request_leaves_no_reference_cycle(engine) -> None:
    """What a request's stream holds (its caller's sink, and what that holds) goes when the request
    ends, by reference counting: none of it waits for the cyclic GC, whose collections pause every
    thread of the process (the serving processes collect their young generation rarely for that)."""
    import gc
    import weakref

    done = asyncio.Event()

    class Sink:
        def __call__(self, out) -> None:  # noqa: ANN001
            if isinstance(out, BaseException) or out.finished:
                done.set()

    sink = Sink()
    gone = weakref.ref(sink)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    gc.disable()
    try:
        engine.start("no-cycle", [5, 6, 7], params, sink)
        del sink
        await asyncio.wait_for(done.wait(), 30)
        # Another request through, so the engine thread's locals (its last command) move on too.
        await _collect(engine, "next", [8, 9], params)
        assert gone() is None
    finally:
        gc.enable()


def test_settle_heap_freezes_startup_and_collects_young_objects_rarely() -> None:
    import gc

    from server.heap import GC_YOUNG_THRESHOLD, settle_heap

    before = gc.get_threshold()
    try:
        settle_heap()
        assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, *before[1:])
        assert gc.get_freeze_count() > 0
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()
