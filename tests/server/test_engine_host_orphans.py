"""EngineHost counts the requests of an API server whose connection closed (it died): each once, as
an abort with its prompt tokens, except those the API server had asked to abort (it counted them)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from engine import SamplingParams
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from server.engine_host import EngineHost
from server.engine_ipc import Channel
from server.metrics import ServerMetrics
from tests.server.test_engine_ipc import _hosted, _until

LONG = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
PROMPTS = {"r0": [5, 6, 7, 8, 9], "r1": [20, 21, 22], "r2": [40, 41, 42, 43]}


@pytest.fixture
async def engine(tiny_llama) -> AsyncIterator[AsyncEngine]:
    eng = AsyncEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=128))
    yield eng
    await eng.shutdown()


async def test_a_closed_connection_counts_its_requests_once_as_aborts(engine) -> None:
    metrics = ServerMetrics("m")

    def sample(name: str, **labels: str) -> float:
        return metrics.registry.get_sample_value(name, {"model_name": "m", **labels}) or 0.0

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
