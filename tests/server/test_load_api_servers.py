"""``GET /load`` behind ``--api-server-count 2``: the replica's requests on the engine's routes,
every API server's, from whichever API server answers (as ``/metrics`` covers the replica), not
the answering one's alone. Requests are held by a sleeping engine, so the count stays put."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from http.client import HTTPConnection
from pathlib import Path

import httpx
import pytest

from tests.server.test_api_servers import call, connection_per_api_server


@pytest.fixture(scope="module")
def replica(tiny_llama: Path, serve_logs: Path, server_process) -> Iterator:
    flags = ["--api-server-count", "2", "--enable-sleep-mode", "--num-kv-blocks", "64"]
    srv = server_process(tiny_llama, flags, serve_logs).start()
    yield srv
    httpx.post(srv.url + "/wake_up", timeout=30)  # a failed test may have left requests held
    assert srv.stop() == 0, srv.log()


def _loads(conns: list[HTTPConnection]) -> list[int]:
    answers = [call(conn, "/load") for conn in conns]
    assert all(status == 200 for status, _ in answers), answers
    return [body["server_load"] for _, body in answers]


def _settled(conns: list[HTTPConnection], value: int, timeout: float = 60.0) -> list[int]:
    """Each API server's ``/load`` once all answer ``value`` (the others' part of it comes through
    the engine process within ~0.15 s), or as they were at the deadline."""
    deadline = time.monotonic() + timeout
    while (loads := _loads(conns)) != [value] * len(conns) and time.monotonic() < deadline:
        time.sleep(0.02)
    return loads


def test_load_is_the_replicas_from_either_api_server(replica) -> None:
    first_held, second_held = connection_per_api_server(replica)
    also_first, spare = connection_per_api_server(replica)
    first_ask, second_ask = connection_per_api_server(replica)
    spare.close()
    assert _settled([first_ask, second_ask], 0) == [0, 0]
    status, _ = call(first_ask, "/sleep", method="POST")
    assert status == 200
    # Two requests held on the first API server, one on the second.
    body = json.dumps({"prompt": "x", "max_tokens": 4, "ignore_eos": True})
    held = [first_held, also_first, second_held]
    for conn in held:
        conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
    assert _settled([first_ask, second_ask], 3) == [3, 3]
    time.sleep(0.3)  # several reports and broadcasts later: still exactly the three
    assert _loads([first_ask, second_ask]) == [3, 3]
    status, _ = call(second_ask, "/wake_up", method="POST")
    assert status == 200
    for conn in held:
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] == 4
    assert _settled([first_ask, second_ask], 0) == [0, 0]
    for conn in [*held, first_ask, second_ask]:
        conn.close()
