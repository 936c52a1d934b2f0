"""What the per-request histograms count, exactly: one TTFT and n - 1 inter-token samples per
engine request of n tokens, however its tokens were grouped into deltas; every request that ran
ends once in ``request_success``, e2e latency and the token histograms, an abandoned one too (as
``abort``, with the tokens it got); a request the engine refused (a 400) is not counted.

The engine-level cases run ``Generation`` over a real ``AsyncEngine`` in this test's event loop
(which the test can hold, as a busy server's is); the HTTP ones use the shared replica.

Counts (``_count``, ``_sum`` of token histograms) are compared, never timings.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from engine import SamplingParams
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from server.config import ServerConfig
from server.errors import APIError
from server.generation import Generation
from server.metrics import ServerMetrics
from server.sequence_request import SequenceRequest
from tests.server.conftest import metric_value

PER_TOKEN = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
# The series every request that ran ends in, once.
PER_END = (
    "vllm:e2e_request_latency_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
)


@pytest.fixture
async def engine(tiny_llama: Path) -> AsyncIterator[AsyncEngine]:
    eng = AsyncEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=64))
    # No burst gathering: it runs a probe through this test's event loop, which the test holds.
    eng.arrival_wait_s = 0.0
    yield eng
    await eng.shutdown()


async def test_a_first_delta_of_several_tokens_counts_each_token(engine: AsyncEngine) -> None:
    """The server reads the engine's outputs late (its loop was busy): the first delta carries
    every token made by then. Its first token is the TTFT; each other one is an inter-token
    sample, so the request still counts n - 1 of them."""
    metrics = ServerMetrics("m")
    generation = Generation(engine, ServerConfig(served_model_name="m"), metrics)
    n = 6
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    seq = SequenceRequest(choice_index=0, prompt_index=0, prompt_token_ids=[5, 6, 7, 8, 9], params=params)
    made = engine.stats().generation_tokens
    outs = generation.stream("late-reader", seq, time.perf_counter(), generation.admit(1))
    first = asyncio.ensure_future(anext(outs))
    await asyncio.sleep(0)  # the stream submits the request, then waits for its first output
    # Hold this loop, as a busy server does, until the engine has made the whole answer. Its
    # stats are published before each step's outputs are handed over, so all the steps but the
    # last are surely waiting to be read; the last may come in a delta of its own.
    deadline = time.monotonic() + 60
    while engine.stats().generation_tokens < made + n:
        assert time.monotonic() < deadline, "the engine did not generate"
        time.sleep(0.005)
    deltas = [len((await first).outputs[0].token_ids)]
    deltas += [len(out.outputs[0].token_ids) async for out in outs]
    assert sum(deltas) == n and deltas[0] >= n - 1  # the first delta carried several tokens
    text = metrics.render().decode()

    def count(name: str) -> float | None:
        return metric_value(text, name + "_count", model_name="m")

    assert count("vllm:time_to_first_token_seconds") == 1
    assert {name: count(name) for name in PER_TOKEN} == dict.fromkeys(PER_TOKEN, n - 1)
    assert count("vllm:request_time_per_output_token_seconds") == 1
    assert metric_value(text, "vllm:request_generation_tokens_sum", model_name="m") == n


async def test_a_request_the_engine_refuses_is_not_counted(engine: AsyncEngine) -> None:
    """A 400 from the engine (here a token id outside its vocabulary, which the HTTP layer would
    have caught first) is a request that never ran: no ``abort``, no end-to-end latency."""
    metrics = ServerMetrics("m")
    generation = Generation(engine, ServerConfig(served_model_name="m"), metrics)
    params = SamplingParams(max_tokens=3, temperature=0.0)
    seq = SequenceRequest(choice_index=0, prompt_index=0, prompt_token_ids=[5, 10**9], params=params)
    with pytest.raises(APIError) as err:
        async for _ in generation.stream("refused", seq, time.perf_counter(), generation.admit(1)):
            pass
    assert err.value.status == 400
    text = metrics.render().decode()
    assert metric_value(text, "vllm:request_success_total", model_name="m", finished_reason="abort") == 0
    for name in PER_END:
        assert metric_value(text, name + "_count", model_name="m") == 0, name


def _counts(url: str, name: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text

    def read(series: str, **labels: str) -> float:
        return metric_value(text, series, model_name=name, **labels) or 0.0

    out = {s: read(s + "_count") for s in ("vllm:time_to_first_token_seconds", *PER_TOKEN, *PER_END)}
    out["vllm:request_time_per_output_token_seconds"] = read(
        "vllm:request_time_per_output_token_seconds_count"
    )
    out["prompt_tokens_sum"] = read("vllm:request_prompt_tokens_sum")
    out["generation_tokens_sum"] = read("vllm:request_generation_tokens_sum")
    out["max_generation_tokens_count"] = read("vllm:request_max_num_generation_tokens_count")
    out["max_generation_tokens_sum"] = read("vllm:request_max_num_generation_tokens_sum")
    for reason in ("stop", "length", "abort"):
        out[reason] = read("vllm:request_success_total", finished_reason=reason)
    out["running"] = read("vllm:num_requests_running") + read("vllm:num_requests_waiting")
    return out


def _settled(url: str, name: str, timeout: float = 60.0) -> dict[str, float]:
    """The counts once no request is in the engine (an abandoned one is counted before its engine
    request is aborted, so nothing of one that left earlier is still to come)."""
    deadline = time.monotonic() + timeout
    while (now := _counts(url, name))["running"] != 0:
        assert time.monotonic() < deadline, "the replica never went idle"
        time.sleep(0.02)
    return now


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in before if k != "running"}


def test_a_stream_the_client_leaves_is_counted_with_its_tokens(server) -> None:
    url, name = server.url, server.model_name
    prompt = list(range(40, 57))  # 17 tokens
    body = {"model": name, "prompt": prompt, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    before = _settled(url, name)
    read = 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                read += 1
            if read == 5:
                break  # the client leaves mid-stream
    delta = _delta(_settled(url, name), before)
    got = delta["generation_tokens_sum"]
    assert 5 <= got < 1000  # at least the tokens the client read, not the whole answer
    assert delta == {
        "vllm:time_to_first_token_seconds": 1,
        **dict.fromkeys(PER_TOKEN, got - 1),
        **dict.fromkeys(PER_END, 1),
        "vllm:request_time_per_output_token_seconds": 0,  # no engine stamps for an aborted request
        "prompt_tokens_sum": 17,
        "generation_tokens_sum": got,
        "max_generation_tokens_count": 1,
        "max_generation_tokens_sum": got,
        "stop": 0,
        "length": 0,
        "abort": 1,
    }


def test_finished_requests_count_every_token(server) -> None:
    """A whole answer and a stream count once in every per-request series and n - 1 times in the
    per-token ones (a whole answer's server reads its outputs as it can: often several at once)."""
    url, name = server.url, server.model_name
    before = _settled(url, name)
    plain = {"model": name, "prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True}
    assert httpx.post(url + "/v1/completions", json=plain, timeout=60).status_code == 200
    streamed = {**plain, "max_tokens": 3, "stream": True}
    assert httpx.post(url + "/v1/completions", json=streamed, timeout=60).text.endswith("data: [DONE]\n\n")
    assert _delta(_settled(url, name), before) == {
        "vllm:time_to_first_token_seconds": 2,
        **dict.fromkeys(PER_TOKEN, 3 + 2),
        **dict.fromkeys(PER_END, 2),
        "vllm:request_time_per_output_token_seconds": 2,
        "prompt_tokens_sum": 6,
        "generation_tokens_sum": 7,
        "max_generation_tokens_count": 2,
        "max_generation_tokens_sum": 7,
        "stop": 0,
        "length": 2,
        "abort": 0,
    }


def test_the_longest_choice_is_counted_once_per_prompt(server) -> None:
    """``vllm:request_max_num_generation_tokens`` (the stock vLLM dashboard's "Max Generation
    Token" panel) has one sample per prompt of a request, its longest choice, as vLLM's once per
    parent request; and the deprecated ``vllm:gpu_cache_usage_perc`` it plots is the KV usage."""
    url, name = server.url, server.model_name
    before = _settled(url, name)
    body = {"model": name, "prompt": [[5, 6, 7], [8, 9]], "n": 2, "max_tokens": 3, "ignore_eos": True}
    assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
    delta = _delta(_settled(url, name), before)
    assert (delta["generation_tokens_sum"], delta["vllm:request_generation_tokens"]) == (12, 4)
    assert (delta["max_generation_tokens_count"], delta["max_generation_tokens_sum"]) == (2, 6)
    text = httpx.get(url + "/metrics", timeout=10).text
    usage = metric_value(text, "vllm:kv_cache_usage_perc", model_name=name)
    assert usage is not None
    assert metric_value(text, "vllm:gpu_cache_usage_perc", model_name=name) == usage
