"""`ferry serve --api-server-count 2`: the requests of an API server that is SIGKILLed are counted.

The dead process cannot count them, and the engine process aborts them when its connection
closes: it counts them there, each once as an abort with the tokens it had (as an API server counts
a request whose client left), and the surviving API server's /metrics shows them. A beam search is
counted as its API server counts one: once per answer, not once per step request.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.test_api_servers import (
    API_SERVERS,
    _client_ports,
    _owner,
    _processes,
    _socket_inodes,
    _Stream,
    _wait,
)


@pytest.fixture(scope="module")
def server(tiny_llama: Path, serve_logs: Path, server_process) -> Iterator:
    srv = server_process(tiny_llama, [*API_SERVERS, "--num-kv-blocks", "1024"], serve_logs).start()
    yield srv
    assert srv.stop() == 0, srv.log()


def _reader(server, scrape):
    """A reader of the server's metrics (0 for one not yet exported) and ``/tokenize`` of "x"."""
    name = server.model_name

    def read(metric: str, **labels: str) -> float:
        return scrape(server.url, metric, model_name=name, **labels) or 0.0

    prompt = httpx.post(server.url + "/tokenize", json={"model": name, "prompt": "x"}, timeout=30).json()
    return read, prompt


def test_requests_of_a_killed_api_server_are_counted_once_as_aborts(server, scrape) -> None:
    _, api = _processes(server)
    read, prompt = _reader(server, scrape)
    aborted = read("vllm:request_success_total", finished_reason="abort")
    prompts = read("vllm:request_prompt_tokens_count")
    prompt_tokens = read("vllm:request_prompt_tokens_sum")
    generations = read("vllm:request_generation_tokens_count")
    body = {"prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    before = _client_ports(server.port)
    streams = [_Stream(server.url, body) for _ in range(6)]  # each has its first tokens
    inodes = {pid: _socket_inodes(pid) for pid in api}
    owners = [_owner(inodes, server.port, port) for port in _client_ports(server.port) - before]
    held = {pid: owners.count(pid) for pid in api}
    assert sum(held.values()) == 6, held
    victim = max(held, key=held.__getitem__)
    killed = held[victim]
    os.kill(victim, signal.SIGKILL)
    survivors = 6 - killed
    _wait(
        lambda: read("vllm:num_requests_running") == survivors,
        60,
        "the dead API server's requests still run",
    )
    # Counted when the engine process saw the connection close, before it aborted them: each of
    # the killed server's streams once, none of the survivors' (still running).
    assert read("vllm:request_success_total", finished_reason="abort") == aborted + killed
    assert read("vllm:request_prompt_tokens_count") == prompts + killed
    assert read("vllm:request_prompt_tokens_sum") == prompt_tokens + killed * prompt["count"]
    assert read("vllm:request_generation_tokens_count") == generations + killed
    # The killed server's streams break once their reader threads see the connection go.
    _wait(
        lambda: sum(s.state == "running" for s in streams) == survivors,
        60,
        "the killed server's streams did not break",
    )
    for stream in streams:
        stream.close()
    # The survivors, left by their client, are counted by their own API server: once each.
    _wait(lambda: read("vllm:num_requests_running") == 0, 60, "the survivors still run")
    _wait(
        lambda: read("vllm:request_success_total", finished_reason="abort") == aborted + 6,
        30,
        "the survivors were not counted",
    )


def test_a_beam_search_of_a_killed_api_server_is_counted_once_per_answer(server, scrape) -> None:
    _wait(lambda: len(_processes(server)[1]) == 2, 60, "no second API server")  # one may be replaced
    _, api = _processes(server)
    read, prompt = _reader(server, scrape)
    aborted = read("vllm:request_success_total", finished_reason="abort")
    prompt_tokens = read("vllm:request_prompt_tokens_sum")
    generations = read("vllm:request_generation_tokens_count")
    processed = read("vllm:generation_tokens_total")
    body = {"prompt": "x", "max_tokens": 1000, "n": 2, "use_beam_search": True, "ignore_eos": True}
    before = _client_ports(server.port)
    client = httpx.Client(timeout=120)

    def post() -> None:
        try:
            client.post(server.url + "/v1/completions", json=body)
        except httpx.HTTPError:
            pass  # its API server was killed

    thread = threading.Thread(target=post, daemon=True)
    thread.start()
    _wait(lambda: _client_ports(server.port) - before, 30, "no connection")
    # Its steps run (one-token requests: between steps nothing of it is in the engine).
    _wait(lambda: read("vllm:generation_tokens_total") >= processed + 20, 60, "the search never ran")
    inodes = {pid: _socket_inodes(pid) for pid in api}
    (port,) = _client_ports(server.port) - before
    victim = _owner(inodes, server.port, port)
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    thread.join(60)

    def counted() -> bool:
        try:
            return read("vllm:request_success_total", finished_reason="abort") == aborted + 2
        except httpx.HTTPError:  # a scrape the killed process had accepted before it died
            return False

    # Its two answers, each once as an abort with the prompt's tokens; none of its step requests.
    _wait(counted, 30, "the search was not counted")
    assert read("vllm:request_prompt_tokens_sum") == prompt_tokens + 2 * prompt["count"]
    assert read("vllm:request_generation_tokens_count") == generations + 2
    client.close()
