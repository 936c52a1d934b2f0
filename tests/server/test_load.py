"""Behaviour under load: concurrency, client disconnects, admission control (429), timeouts, API key.

Loopback only, bounded in count and time.
"""

from __future__ import annotations

import asyncio
import gzip
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families
from prometheus_client.parser import text_string_to_metric_families as prometheus_text_families

PROMPTS = [f"def function_{i}(x):\n    return" for i in range(64)]


async def _stream_text(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> tuple[list[int], str]:
    """A greedy stream's token ids (exact, via logprobs as token ids) and finish reason."""
    stream = await client.completions.create(
        model=None,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    ids, reason = [], None
    async for chunk in stream:
        lp = chunk.choices[0].logprobs
        ids += [int(t.removeprefix("token_id:")) for t in (lp.tokens if lp else [])]
        reason = chunk.choices[0].finish_reason or reason
    return ids, reason


async def test_64_concurrent_streams_get_what_they_get_alone(server) -> None:
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    alone = [await _stream_text(client, p, 12) for p in PROMPTS[:8]]
    together = await asyncio.gather(*(_stream_text(client, p, 12) for p in PROMPTS))
    assert all(reason == "length" and len(ids) == 12 for ids, reason in together)
    assert together[:8] == alone
    # and the rest against a second, sequential pass
    for i in (8, 31, 63):
        assert together[i] == await _stream_text(client, PROMPTS[i], 12)


def _wait_idle(url: str, scrape, model: str, timeout: float = 60) -> None:
    """Wait until the engine reports nothing running and no KV block in use. The bound only guards
    against a hang: how soon an abort frees a request is shown by the abort counter, not a clock."""
    deadline = time.monotonic() + timeout
    while True:
        running = scrape(url, "vllm:num_requests_running", model_name=model)
        waiting = scrape(url, "vllm:num_requests_waiting", model_name=model)
        usage = scrape(url, "vllm:kv_cache_usage_perc", model_name=model)
        if running == 0 and waiting == 0 and usage == 0:
            return
        assert time.monotonic() < deadline, "engine did not go idle"
        time.sleep(0.02)


def _aborted(url: str, scrape, model: str) -> float:
    return _finished(url, scrape, model, "abort")


def _finished(url: str, scrape, model: str, reason: str) -> float:
    return scrape(url, "vllm:request_success_total", model_name=model, finished_reason=reason) or 0


def test_disconnect_mid_stream_frees_blocks(server, scrape) -> None:
    name = server.model_name
    aborted_before = _aborted(server.url, scrape, name)
    body = {"prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert scrape(server.url, "vllm:num_requests_running", model_name=name) == 1
        assert scrape(server.url, "vllm:kv_cache_usage_perc", model_name=name) > 0
    # Ended by the abort (a request left to run would end at its length): everything is freed.
    _wait_idle(server.url, scrape, name)
    assert _aborted(server.url, scrape, name) == aborted_before + 1


async def test_disconnect_non_streaming_frees_blocks(server, scrape) -> None:
    name = server.model_name
    aborted_before = _aborted(server.url, scrape, name)
    async with httpx.AsyncClient(timeout=30) as client:
        task = asyncio.ensure_future(
            client.post(
                server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1000, "ignore_eos": True}
            )
        )
        deadline = time.monotonic() + 60
        while scrape(server.url, "vllm:num_requests_running", model_name=name) != 1:
            assert time.monotonic() < deadline, "request never started running"
            await asyncio.sleep(0.02)
        task.cancel()  # closes the connection
        with pytest.raises(asyncio.CancelledError):
            await task
    _wait_idle(server.url, scrape, name)
    assert _aborted(server.url, scrape, name) == aborted_before + 1


@pytest.fixture(scope="module")
def tight(tiny_llama: Path, serve_logs: Path, server_process):
    """A replica with 2 running slots, a queue of 2, a 1 s request timeout, an API key and the
    in-process KV tier (whose ferry: metrics must show on /metrics)."""
    flags = [
        "--max-num-seqs",
        "2",
        "--max-queued-requests",
        "2",
        "--request-timeout",
        "1",
        "--api-key",
        "sekrit",
        "--num-kv-blocks",
        "512",
        "--kv-tier",
        "memory://",
    ]
    srv = server_process(tiny_llama, flags, serve_logs).start()
    yield srv
    srv.stop()


AUTH = {"Authorization": "Bearer sekrit"}


def test_api_key_guards_v1_but_not_health_or_metrics(tight) -> None:
    body = {"prompt": "x", "max_tokens": 1}
    r = httpx.post(tight.url + "/v1/completions", json=body)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert (
        httpx.post(
            tight.url + "/v1/completions", json=body, headers={"Authorization": "Bearer no"}
        ).status_code
        == 401
    )
    assert httpx.post(tight.url + "/tokenize", json={"prompt": "x"}).status_code == 401
    assert httpx.post(tight.url + "/reset_prefix_cache").status_code == 401
    assert httpx.post(tight.url + "/reset_prefix_cache", headers=AUTH).status_code in (200, 409)
    assert httpx.post(tight.url + "/v1/completions", json=body, headers=AUTH).status_code == 200
    assert httpx.get(tight.url + "/health").status_code == 200
    assert httpx.get(tight.url + "/metrics").status_code == 200
    sdk = openai.OpenAI(base_url=tight.url + "/v1", api_key="sekrit", max_retries=0)
    assert sdk.models.list().data[0].id == tight.model_name
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=tight.url + "/v1", api_key="wrong", max_retries=0).models.list()


async def test_flood_gets_429_with_retry_after(tight, scrape) -> None:
    body = {"prompt": "x", "max_tokens": 200, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=60, headers=AUTH) as client:
        responses = await asyncio.gather(
            *(client.post(tight.url + "/v1/completions", json=body) for _ in range(16))
        )
    codes = [r.status_code for r in responses]
    rejected = [r for r in responses if r.status_code == 429]
    served = [r for r in responses if r.status_code in (200, 408)]
    assert len(rejected) + len(served) == 16, codes
    assert 4 <= len(served) <= 6 and rejected, codes  # 2 running + 2 queued (+ arrivals racing the engine)
    assert all(r.headers["retry-after"].isdigit() for r in rejected)
    assert rejected[0].json()["error"]["type"] == "RateLimitError"
    assert scrape(tight.url, "ferry:server_rejected_requests_total", model_name=tight.model_name) >= len(
        rejected
    )
    # the replica is still fine
    ok = httpx.post(tight.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=AUTH)
    assert ok.status_code == 200


def test_request_timeout_aborts_cleanly(tight, scrape) -> None:
    # 16 x 1000 tokens through 2 running slots: far more than 1 s of work on any machine (one
    # 1000-token sequence alone can finish within the second on a fast one). The timeout aborts the
    # rest: counted as aborted sequences, not ones that ran to their length (no clock needed).
    body = {"prompt": "x", "max_tokens": 1000, "ignore_eos": True, "n": 16}
    name = tight.model_name
    for stream in (False, True):
        aborted, by_length = _aborted(tight.url, scrape, name), _finished(tight.url, scrape, name, "length")
        if stream:
            with httpx.stream(
                "POST", tight.url + "/v1/completions", json={**body, "stream": True}, headers=AUTH, timeout=60
            ) as s:
                text = s.read().decode()
            assert text.endswith("data: [DONE]\n\n") and '"code":"request_timeout"' in text
        else:
            r = httpx.post(tight.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
            assert r.status_code == 408 and r.json()["error"]["code"] == "request_timeout"
        _wait_idle(tight.url, scrape, name)
        aborted = _aborted(tight.url, scrape, name) - aborted
        by_length = _finished(tight.url, scrape, name, "length") - by_length
        assert aborted + by_length == 16 and aborted >= 8, (aborted, by_length)


def test_kv_tier_metrics_share_the_endpoint(tight) -> None:
    text = httpx.get(tight.url + "/metrics").text
    assert "ferry:kv_tier_hits_total" in text  # registered by kvcache on the default registry
    assert f'vllm:num_requests_running{{engine="0",model_name="{tight.model_name}"}}' in text


def test_metrics_answer_in_the_format_asked_for(tight) -> None:
    """As prometheus-client's exposition app (which vLLM mounts): the text format by default,
    OpenMetrics when the scrape asks for it, every family whole (``vllm:`` names kept)."""
    r = httpx.get(tight.url + "/metrics")
    assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    r = httpx.get(tight.url + "/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"})
    assert r.headers["content-type"].startswith("application/openmetrics-text; version=1.0.0; charset=utf-8")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}  # one valid exposition
    running = families["vllm:num_requests_running"]
    assert running.type == "gauge" and [s.labels for s in running.samples] == [
        {"engine": "0", "model_name": tight.model_name}
    ]
    assert "ferry:kv_tier_hits" in families


@pytest.mark.parametrize(
    ("accept_encoding", "gzipped"),
    [
        ("gzip", True),
        ("br, gzip;q=0.5", True),
        ("*", True),
        ("identity", False),
        ("gzip;q=0", False),
        ("*, gzip;q=0", False),
        ("", False),
    ],
)
def test_metrics_are_gzipped_when_the_scrape_takes_gzip(tight, accept_encoding, gzipped) -> None:
    """As prometheus-client's exposition app: gzip when ``Accept-Encoding`` takes it (Prometheus
    always sends ``gzip``), the same exposition inside."""
    with httpx.stream("GET", tight.url + "/metrics", headers={"accept-encoding": accept_encoding}) as r:
        raw = b"".join(r.iter_raw())
    assert r.status_code == 200 and "accept-encoding" in r.headers["vary"].lower()
    assert r.headers.get("content-encoding") == ("gzip" if gzipped else None)
    assert int(r.headers["content-length"]) == len(raw)
    text = (gzip.decompress(raw) if gzipped else raw).decode()
    names = {f.name for f in prometheus_text_families(text)}
    assert {"vllm:num_requests_running", "vllm:kv_cache_usage_perc"} <= names


def test_disconnect_mid_responses_stream_frees_blocks(server, scrape) -> None:
    # /v1/responses wraps the chat stream in its own event stream: closing it must close (and so
    # abort) the chat stream inside, not leave it generating until garbage collection.
    name = server.model_name
    aborted_before = _aborted(server.url, scrape, name)
    body = {"input": "x", "max_output_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=30) as r:
        lines = r.iter_lines()  # kept: a dropped httpx line iterator closes the response
        for line in lines:
            if '"response.output_text.delta"' in line:
                break
        assert scrape(server.url, "vllm:num_requests_running", model_name=name) == 1
    _wait_idle(server.url, scrape, name)
    assert _aborted(server.url, scrape, name) == aborted_before + 1


async def test_load_counts_requests_on_the_engine_routes(server) -> None:
    # vLLM's GET /load: requests on the engine's routes from arrival to their last byte.
    assert httpx.get(server.url + "/load").json() == {"server_load": 0}
    long = {"max_tokens": 1000, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        running = [
            asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "x", **long})),
            asyncio.ensure_future(
                client.post(
                    "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], **long}
                )
            ),
        ]
        seen = set()
        while not all(t.done() for t in running):
            await client.get("/v1/models")  # not an engine route: never counted
            seen.add((await client.get("/load")).json()["server_load"])
            await asyncio.sleep(0.01)
        assert all(t.result().status_code == 200 for t in running)
    assert max(seen) == 2
    assert httpx.get(server.url + "/load").json() == {"server_load": 0}
