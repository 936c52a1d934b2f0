"""``--max-queued-requests`` over HTTP, against real ``ferry serve`` processes (one process, and an
engine process behind two API servers): the limit counts sequences (prompts x n), one request
cannot take the queue past it (one larger than it ever queues waits for an empty queue), and with several API
servers the bound holds exactly, however the requests spread over them.

The engine sleeps (sleep mode) while requests are sent: it holds every request, so nothing runs
or finishes and the counts are exact; while it sleeps every sequence is queued (no batch slot
runs one), so the replica holds exactly ``--max-queued-requests`` sequences. The engine's waiting
gauge (held requests included) says when the admitted sequences have reached it.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.client import HTTPConnection
from pathlib import Path
from typing import Any

import pytest

from tests.server.conftest import metric_value
from tests.server.test_api_servers import connection_per_api_server

SLOTS, LIMIT = 2, 3  # --max-num-seqs, --max-queued-requests
ONE = {"prompt": "x", "max_tokens": 2, "ignore_eos": True}


@pytest.fixture(scope="module", params=["one process", "api servers"])
def replica(request, tiny_llama: Path, serve_logs: Path, server_process) -> Iterator:
    flags = ["--enable-sleep-mode", "--num-kv-blocks", "256"]
    flags += ["--max-num-seqs", str(SLOTS), "--max-queued-requests", str(LIMIT)]
    if request.param == "api servers":
        flags += ["--api-server-count", "2"]
    srv = server_process(tiny_llama, flags, serve_logs).start()
    srv.api_servers = 2 if request.param == "api servers" else 1
    yield srv
    _post(HTTPConnection("127.0.0.1", srv.port, timeout=30), "/wake_up")  # a failed test may hold some
    assert srv.stop() == 0, srv.log()


class _Answer:
    def __init__(self, status: int, headers: dict[str, str], body: Any) -> None:
        self.status, self.headers, self.body = status, headers, body

    def __repr__(self) -> str:
        return f"{self.status} {self.body}"


def _post(conn: HTTPConnection, path: str, body: dict | None = None) -> _Answer:
    conn.request("POST", path, body=json.dumps(body or {}), headers={"content-type": "application/json"})
    r = conn.getresponse()
    data = r.read().decode()
    headers = {k.lower(): v for k, v in r.getheaders()}
    if headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in data.splitlines() if line.startswith("data: ")]
        return _Answer(r.status, headers, [e if e == "[DONE]" else json.loads(e) for e in events])
    return _Answer(r.status, headers, json.loads(data) if data else None)


def _connections(srv, count: int) -> list[HTTPConnection]:
    """``count`` keep-alive connections; behind two API servers, alternately on each."""
    if srv.api_servers == 1:
        return [HTTPConnection("127.0.0.1", srv.port, timeout=60) for _ in range(count)]
    conns: list[HTTPConnection] = []
    while len(conns) < count:
        conns += connection_per_api_server(srv)
    for extra in conns[count:]:
        extra.close()
    return conns[:count]


class _Sent:
    """Requests sent at once, one thread per connection, released together by a barrier."""

    def __init__(self, conns: list[HTTPConnection], bodies: list[dict]) -> None:
        self.answers: list[_Answer | None] = [None] * len(conns)
        barrier = threading.Barrier(len(conns))

        def send(i: int) -> None:
            barrier.wait()
            self.answers[i] = _post(conns[i], "/v1/completions", bodies[i])

        self._threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(len(conns))]
        for thread in self._threads:
            thread.start()

    def answered(self) -> list[_Answer]:
        return [a for a in self.answers if a is not None]

    def wait_answered(self, count: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.answered()) < count:
            assert time.monotonic() < deadline, f"only {self.answered()} answered, {count} expected"
            time.sleep(0.01)

    def join(self) -> list[_Answer]:
        for thread in self._threads:
            thread.join(60)
        assert all(a is not None for a in self.answers), self.answers
        return self.answers  # type: ignore[return-value]


def _waiting(srv) -> float | None:
    conn = HTTPConnection("127.0.0.1", srv.port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return metric_value(text, "vllm:num_requests_waiting", model_name=srv.model_name)


def _wait_waiting(srv, value: int) -> None:
    """Until the engine holds ``value`` sequences (the gauge every API server reads within 2 ms)."""
    deadline = time.monotonic() + 60
    while (now := _waiting(srv)) != value:
        assert time.monotonic() < deadline, f"{now} sequences waiting, {value} expected"
        time.sleep(0.01)


def _sleep(srv, conns: list[HTTPConnection]) -> None:
    assert _post(conns[0], "/sleep?level=1").status == 200
    for conn in conns:  # every API server has heard of it (from the engine's pushed stats)
        deadline = time.monotonic() + 60
        while True:
            conn.request("GET", "/is_sleeping")
            if json.loads(conn.getresponse().read())["is_sleeping"]:
                break
            assert time.monotonic() < deadline
            time.sleep(0.01)


def _assert_refused(answer: _Answer) -> None:
    """A 429 in OpenAI's error shape with Retry-After, whichever process refused it."""
    assert answer.status == 429, answer
    error = answer.body["error"]
    assert error["type"] == "RateLimitError" and error["code"] == "rate_limit_exceeded", error
    assert error["message"].startswith("Server is overloaded:"), error
    assert answer.headers["retry-after"] == "1"


def test_a_request_counts_as_its_sequences(replica) -> None:
    conns = _connections(replica, 3)
    # More sequences than the replica ever queues (2 running + 3 waiting): admitted onto an empty
    # queue, streamed or not (a batch of many prompts is served, as vLLM serves it).
    six = {**ONE, "prompt": ["a", "b", "c"], "n": 2}
    answer = _post(conns[0], "/v1/completions", six)
    assert answer.status == 200 and len(answer.body["choices"]) == 6, answer
    answer = _post(conns[-1], "/v1/completions", {**six, "stream": True})
    assert answer.status == 200 and answer.body[-1] == "[DONE]", answer
    assert {c["index"] for e in answer.body[:-1] for c in e["choices"]} == set(range(6))
    _sleep(replica, conns)
    # Asleep, every sequence waits: 2 prompts x n=2 would make 4 queued, past the limit of 3, on an
    # empty queue (one request used to pass as one).
    for stream in (False, True):
        answer = _post(conns[-1], "/v1/completions", {**ONE, "prompt": ["a", "b"], "n": 2, "stream": stream})
        _assert_refused(answer)
        assert "this request's 4 would make 4 (limit 3)" in answer.body["error"]["message"]
    # One sequence waits: the batch larger than the replica queues now waits for an empty queue.
    first = _Sent(conns[:1], [ONE])
    _wait_waiting(replica, 1)
    answer = _post(conns[-1], "/v1/completions", six)
    _assert_refused(answer)
    assert answer.body["error"]["message"] == (
        "Server is overloaded: this request's 6 sequences (prompts x n) are more than it queues "
        "(2 running, 3 waiting), so they wait for an empty queue; 1 sequences are waiting. Retry later."
    )
    # 2 prompts more fit exactly; then not one more sequence, through either API server.
    held = _Sent(conns[1:2], [{**ONE, "prompt": ["a", "b"]}])
    _wait_waiting(replica, 3)
    _assert_refused(_post(conns[-1], "/v1/completions", ONE))
    _assert_refused(_post(conns[-1], "/v1/completions", {**ONE, "stream": True}))
    assert _post(conns[-1], "/wake_up").status == 200
    (answer,) = held.join()
    assert answer.status == 200 and len(answer.body["choices"]) == 2, answer
    (answer,) = first.join()
    assert answer.status == 200 and len(answer.body["choices"]) == 1, answer
    for conn in conns:
        conn.close()


def test_concurrent_clients_get_exactly_the_limit(replica) -> None:
    """Ten clients at once (behind two API servers, five on each; half of them streaming): exactly
    three admitted, however the API servers' own views raced; the others refused with the same
    429, a streamed one before its stream starts."""
    conns = _connections(replica, 10)
    control = HTTPConnection("127.0.0.1", replica.port, timeout=60)
    _sleep(replica, [*conns, control])
    sent = _Sent(conns, [{**ONE, "stream": i % 2 == 1} for i in range(10)])
    sent.wait_answered(10 - LIMIT)
    _wait_waiting(replica, LIMIT)
    assert _post(control, "/wake_up").status == 200
    answers = sent.join()
    refused = [a for a in answers if a.status != 200]
    assert len(refused) == 10 - LIMIT, answers
    for answer in refused:
        _assert_refused(answer)
    for answer in answers:
        if answer.status == 200 and isinstance(answer.body, list):  # a stream: its tokens, then [DONE]
            assert answer.body[-1] == "[DONE]" and not any("error" in e for e in answer.body[:-1])
    for conn in [*conns, control]:
        conn.close()


@pytest.mark.parametrize("replica", ["api servers"], indirect=True)  # two API servers to race
def test_two_api_servers_cannot_both_admit_a_request_that_fills_the_queue(replica) -> None:
    """Two 3-sequence requests at once, one on each API server, each alone admissible: exactly one
    runs. Each API server's own view cannot know of the other's in time; the engine process decides.
    The refused one streams: it gets a 429, not a 200 carrying an error event. And the places its
    sequences were checked against are freed: the queue takes 3 sequences again afterwards."""
    three = {**ONE, "prompt": ["a", "b", "c"], "stream": True}
    control = HTTPConnection("127.0.0.1", replica.port, timeout=60)
    for _ in range(3):  # the race, three times over
        conns = connection_per_api_server(replica)
        _sleep(replica, [*conns, control])
        sent = _Sent(conns, [three, three])
        sent.wait_answered(1)
        _wait_waiting(replica, 3)
        assert _post(control, "/wake_up").status == 200
        answers = sent.join()
        assert sorted(a.status for a in answers) == [200, 429], answers
        _assert_refused(next(a for a in answers if a.status == 429))
        ran = next(a for a in answers if a.status == 200)
        assert sum(1 for e in ran.body if e != "[DONE]" and e["choices"][0]["finish_reason"]) == 3
        for conn in conns:
            conn.close()
    # Nothing of those requests is held any more: a full queue's worth is admitted again.
    conns = connection_per_api_server(replica)
    _sleep(replica, [*conns, control])
    held = _Sent(conns[1:], [{**ONE, "prompt": ["a", "b", "c"]}])
    _wait_waiting(replica, 3)
    assert _post(control, "/wake_up").status == 200
    assert held.join()[0].status == 200
    for conn in [*conns, control]:
        conn.close()


BEAM = {"prompt": "x", "max_tokens": 2, "ignore_eos": True, "use_beam_search": True, "n": 3}


def test_a_beam_search_holds_its_width_from_start_to_end(replica) -> None:
    """A beam search of width 3 is 3 sequences, as ``n=3`` is: its steps are engine requests of
    their own (one per live beam, its first step one), yet from its first step to its end it holds
    3 places, in the engine process too: the queue is full for the other API server. Its places
    are free once it ends."""
    conns = _connections(replica, 2)
    control = HTTPConnection("127.0.0.1", replica.port, timeout=60)
    _sleep(replica, [*conns, control])
    beam = _Sent(conns[:1], [BEAM])
    _wait_waiting(replica, 1)  # its first step (one live beam), held by the sleeping engine
    for stream in (False, True):
        _assert_refused(_post(conns[-1], "/v1/completions", {**ONE, "stream": stream}))
    # A second search of width 3 (on the other API server, when there are two) does not fit either.
    _assert_refused(_post(conns[-1], "/v1/completions", BEAM))
    assert _post(control, "/wake_up").status == 200
    (answer,) = beam.join()
    assert answer.status == 200 and len(answer.body["choices"]) == 3, answer
    # Nothing of it is held any more: a full queue's worth is admitted again.
    _sleep(replica, [*conns, control])
    held = _Sent(conns[-1:], [{**ONE, "prompt": ["a", "b", "c"]}])
    _wait_waiting(replica, 3)
    assert _post(control, "/wake_up").status == 200
    assert held.join()[0].status == 200
    for conn in [*conns, control]:
        conn.close()
