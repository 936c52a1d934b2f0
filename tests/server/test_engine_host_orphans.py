"""EngineHost counts the requests of an API server whose connection closed (it died): each once, as
an abort with its prompt tokens, except those the API server had asked to abort (it counted them);
a beam search as its API server counts it, once per answer, not per step request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from engine import SamplingParams
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from server.admission import Admission, BeamStep
from server.engine_host import EngineHost
from server.engine_ipc import Channel
from server.metrics import ServerMetrics
from tests.server.test_engine_ipc import _hosted, _until

LONG = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
STEP = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=2)
PROMPTS = {"r0": [5, 6, 7, 8, 9], "r1": [20, 21, 22], "r2": [40, 41, 42, 43]}


@pytest.fixture
async def engine(tiny_llama) -> AsyncIterator[AsyncEngine]:
    eng = AsyncEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=128))
    yield eng
    await eng.shutdown()


async def test_a_closed_connection_counts_its_requests_once_as_aborts(engine) -> None:
    metrics = ServerMetrics("m")

    def sample(name: str, **labels: str) -> float:
        return metrics.registry.get_sample_value(name, {"model_name": "m", "engine": "0", **labels}) or 0.0

    async with _hosted(EngineHost(engine, metrics=metrics)) as where:
        reader, writer = await asyncio.open_unix_connection(where)
        channel = Channel(reader, writer)
        started: set[str] = set()
        for rid, prompt in PROMPTS.items():
            channel.send(("add", rid, None, prompt, LONG, None, None, False, None, 0, None, None))
        while started != set(PROMPTS):  # every one has produced tokens
            frame = await channel.receive()
            assert frame is not None and not [m for m in frame if m[0] == "err"], frame
            started |= {m[1] for m in frame if m[0] == "out"}
        # It counted r0 itself (as an API server does when its client leaves), then died at once.
        channel.send(("call", -1, "abort", "r0"), now=True)
        channel.close()
        await _until(lambda: engine.stats().num_running == 0, "the dead connection's requests still run")
    assert sample("vllm:request_success_total", finished_reason="abort") == 2
    assert sample("vllm:request_prompt_tokens_count") == 2
    assert sample("vllm:request_prompt_tokens_sum") == len(PROMPTS["r1"]) + len(PROMPTS["r2"])
    assert sample("vllm:request_generation_tokens_count") == 2
    assert sample("vllm:request_generation_tokens_sum") >= 2  # at least the first token of each
    assert sample("vllm:request_success_total", finished_reason="length") == 0


async def test_a_closed_connection_counts_its_beam_searches_once_per_answer(engine) -> None:
    """A beam search runs as one-token step requests, leased and skipped by the per-request count:
    one whose API server died was counted by no one, whether between steps (nothing of it in the
    engine) or mid-step. Each search not yet counted by its API server is counted as that server
    would have: ``choices`` aborts with the prompt's tokens and the steps whose tokens were sent."""
    metrics = ServerMetrics("m")

    def sample(name: str, **labels: str) -> float:
        return metrics.registry.get_sample_value(name, {"model_name": "m", "engine": "0", **labels}) or 0.0

    between = [5, 6, 7, 8, 9]  # request 1, prompt 0: 2 answers, its first step answered
    counted = [20, 21, 22]  # request 1, prompt 1: 2 answers, its API server counted it (beam_end)
    mid_step = [40, 41, 42, 43]  # request 2: 3 answers, its third step running
    steps = [
        ("s-a0", between, STEP, Admission(1, 4, True, BeamStep(0, 2, len(between), 0))),
        ("s-a1", between, STEP, Admission(1, 4, True, BeamStep(0, 2, len(between), 0))),
        ("s-b0", counted, STEP, Admission(1, 4, True, BeamStep(1, 2, len(counted), 0))),
        ("s-c0", mid_step + [1, 2], LONG, Admission(2, 3, True, BeamStep(0, 3, len(mid_step), 2))),
        ("s-c1", mid_step + [3, 4], LONG, Admission(2, 3, True, BeamStep(0, 3, len(mid_step), 2))),
    ]
    async with _hosted(EngineHost(engine, metrics=metrics)) as where:
        reader, writer = await asyncio.open_unix_connection(where)
        channel = Channel(reader, writer)
        for rid, prompt, params, admission in steps:
            channel.send(("add", rid, admission, prompt, params, None, None, False, None, 0, None, None))
        finished: set[str] = set()
        started: set[str] = set()
        while finished != {"s-a0", "s-a1", "s-b0"} or started != {"s-c0", "s-c1"}:
            frame = await channel.receive()
            assert frame is not None and not [m for m in frame if m[0] == "err"], frame
            finished |= {m[1] for m in frame if m[0] == "out" and m[2].finished}
            started |= {m[1] for m in frame if m[0] == "out" and m[1].startswith("s-c")}
        channel.send(("beam_end", 1, 1), now=True)
        channel.close()
        await _until(lambda: engine.stats().num_running == 0, "the dead connection's steps still run")
    assert sample("vllm:request_success_total", finished_reason="abort") == 2 + 3
    assert sample("vllm:request_prompt_tokens_count") == 5
    assert sample("vllm:request_prompt_tokens_sum") == 2 * len(between) + 3 * len(mid_step)
    assert sample("vllm:request_generation_tokens_count") == 5
    assert sample("vllm:request_generation_tokens_sum") == 2 * 1 + 3 * 2
    assert sample("vllm:request_success_total", finished_reason="length") == 0
