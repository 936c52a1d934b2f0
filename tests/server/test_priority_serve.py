"""`ferry serve --scheduling-policy priority`: a request's `priority` (vLLM's field; lower first)
orders the queue, on completions, chat and the Responses API; without the policy it is a 400."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest


@pytest.fixture(scope="module")
def priority_server(tiny_llama: Path, serve_logs: Path, server_process) -> Iterator:
    flags = ["--scheduling-policy", "priority", "--max-num-seqs", "1", "--num-kv-blocks", "128"]
    srv = server_process(tiny_llama, flags, serve_logs).start()
    yield srv
    srv.stop()


def _body(srv, priority: int, max_tokens: int) -> dict:
    return {
        "model": srv.model_name,
        "prompt": [5, 9, 14, 3],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "priority": priority,
    }


async def test_queued_requests_run_in_priority_order(priority_server, scrape) -> None:
    url = priority_server.url + "/v1/completions"
    name = priority_server.model_name
    done: list[str] = []

    def waiting() -> float:
        return scrape(priority_server.url, "vllm:num_requests_waiting", model_name=name) or 0.0

    async with httpx.AsyncClient(timeout=120) as client:

        async def send(tag: str, priority: int) -> str:
            r = await client.post(url, json=_body(priority_server, priority, 4))
            assert r.status_code == 200, r.text
            done.append(tag)
            return r.json()["choices"][0]["text"]

        # The first holds the only sequence slot (and outranks both, so nothing preempts it)
        # while the other two queue behind it, the less urgent one first.
        body = {**_body(priority_server, -5, 1000), "stream": True}
        async with client.stream("POST", url, json=body) as first:
            lines = first.aiter_lines()
            assert (await anext(lines)).startswith("data: ")  # running
            low = asyncio.ensure_future(send("low", 5))
            await _until(lambda: waiting() == 1)
            high = asyncio.ensure_future(send("high", 1))
            await _until(lambda: waiting() == 2)
            async for _ in lines:
                pass
        texts = await asyncio.gather(low, high)
    assert done == ["high", "low"]
    assert texts[0] == texts[1]  # same prompt, same greedy tokens


async def _until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(predicate):
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_every_generation_endpoint_takes_priority(priority_server) -> None:
    name = priority_server.model_name
    for path, body in [
        ("/v1/completions", _body(priority_server, -2, 2)),
        (
            "/v1/chat/completions",
            {"model": name, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "priority": 3},
        ),
        (
            "/v1/responses",
            {"model": name, "input": "x", "max_output_tokens": 2, "priority": 3, "store": False},
        ),
    ]:
        r = httpx.post(priority_server.url + path, json=body, timeout=60)
        assert r.status_code == 200, r.text


def test_priority_without_the_policy_is_a_400(server) -> None:
    for path, body in [
        ("/v1/completions", {"model": server.model_name, "prompt": "x", "max_tokens": 1, "priority": 1}),
        (
            "/v1/chat/completions",
            {"model": server.model_name, "messages": [{"role": "user", "content": "x"}], "priority": -1},
        ),
    ]:
        r = httpx.post(server.url + path, json=body, timeout=60)
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "priority" and "--scheduling-policy priority" in err["message"]
    zero = {"model": server.model_name, "prompt": "x", "max_tokens": 1, "priority": 0}
    assert httpx.post(server.url + "/v1/completions", json=zero, timeout=60).status_code == 200
    wrong = httpx.post(server.url + "/v1/completions", json={**zero, "priority": "high"}, timeout=60)
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "priority"
