"""``--max-queued-requests`` for streamed ``/v1/messages`` behind two API servers: a stream the
engine process refuses (at its first sequence, the stream's first message) is answered a real 529
``overloaded_error`` (the Messages API's word for ferry's 429: Anthropic's SDKs raise
``OverloadedError`` and retry it) with Retry-After, in Anthropic's error shape, as completions and
chat streams answer their 429, not a 200 whose stream carries an error event. (A streamed
``/v1/responses`` still sends ``response.created`` at once, as OpenAI's does, so such a refusal
reaches it as an error event.)

The approach is ``test_admission``'s: the engine sleeps (sleep mode) so every admitted sequence
waits and the counts are exact; two sequences are held, then two one-sequence streams, one on each
API server, race for the last place. Each API server's own view can admit its stream; the engine
process's check is the one that holds, so exactly one runs. The race runs a few times over: any
round the engine process decides is one a 200-with-an-error-event would fail.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.client import HTTPConnection
from pathlib import Path

import anthropic
import pytest

from tests.server.test_admission import _Answer, _post, _sleep, _wait_waiting
from tests.server.test_api_servers import connection_per_api_server

SLOTS, LIMIT = 2, 3  # --max-num-seqs, --max-queued-requests
ROUNDS = 5  # a round the API server refuses on its own view passes either way


@pytest.fixture(scope="module")
def replica(tiny_llama: Path, serve_logs: Path, server_process) -> Iterator:
    flags = ["--enable-sleep-mode", "--num-kv-blocks", "256", "--api-server-count", "2"]
    flags += ["--max-num-seqs", str(SLOTS), "--max-queued-requests", str(LIMIT)]
    srv = server_process(tiny_llama, flags, serve_logs).start()
    yield srv
    _post(HTTPConnection("127.0.0.1", srv.port, timeout=30), "/wake_up")  # a failed test may hold some
    assert srv.stop() == 0, srv.log()


def _sent(conn: HTTPConnection, path: str, body: dict, answers: list[_Answer], go: threading.Barrier):
    def send() -> None:
        go.wait()
        answers.append(_post(conn, path, body))

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def _race(srv, path: str, body: dict) -> list[_Answer]:
    """Two sequences held, then ``body`` streamed on each API server at once; the answers."""
    control = HTTPConnection("127.0.0.1", srv.port, timeout=60)
    holder = HTTPConnection("127.0.0.1", srv.port, timeout=60)
    pair = connection_per_api_server(srv)
    _sleep(srv, [*pair, control])
    held: list[_Answer] = []
    hold = _sent(
        holder, "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2}, held, threading.Barrier(1)
    )
    _wait_waiting(srv, 2)
    answers: list[_Answer] = []
    go = threading.Barrier(2)
    racers = [_sent(conn, path, body, answers, go) for conn in pair]
    _wait_waiting(srv, LIMIT)
    # The refused one answers while the engine sleeps; the admitted one once it wakes.
    deadline = time.monotonic() + 60
    while not answers:
        assert time.monotonic() < deadline, "no stream was refused"
        time.sleep(0.01)
    assert _post(control, "/wake_up").status == 200
    for thread in [*racers, hold]:
        thread.join(60)
    assert len(answers) == 2 and held and held[0].status == 200, (answers, held)
    for conn in [*pair, control, holder]:
        conn.close()
    return sorted(answers, key=lambda a: a.status)


def test_a_refused_messages_stream_is_a_529_in_anthropics_shape(replica) -> None:
    body = {
        "model": replica.model_name,
        "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
    }
    for _ in range(ROUNDS):
        ran, refused = _race(replica, "/v1/messages", body)
        assert (ran.status, refused.status) == (200, 529), (ran, refused)
        assert refused.headers["retry-after"] == "1"
        assert refused.headers["content-type"].startswith("application/json"), refused.headers
        assert refused.body["type"] == "error", refused.body
        assert refused.body["error"]["type"] == "overloaded_error", refused.body
        assert refused.body["request_id"] == refused.headers["request-id"], (refused.body, refused.headers)
        assert refused.body["error"]["message"].startswith("Server is overloaded:"), refused.body
        kinds = [event["type"] for event in ran.body]
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "error" not in kinds, kinds


def _asleep_holding(srv, sequences: int) -> tuple[list[HTTPConnection], threading.Thread, list[_Answer]]:
    """The engine asleep, holding ``sequences`` waiting completions sequences: (connections to
    close, the holder's thread, its answer once it is woken)."""
    control = HTTPConnection("127.0.0.1", srv.port, timeout=60)
    holder = HTTPConnection("127.0.0.1", srv.port, timeout=60)
    pair = connection_per_api_server(srv)
    _sleep(srv, [*pair, control])
    held: list[_Answer] = []
    prompts = {"prompt": ["a", "b", "c"][:sequences], "max_tokens": 2}
    thread = _sent(holder, "/v1/completions", prompts, held, threading.Barrier(1))
    _wait_waiting(srv, sequences)
    return [control, holder, *pair], thread, held


def _wake(conns: list[HTTPConnection], thread: threading.Thread, held: list[_Answer]) -> None:
    assert _post(conns[0], "/wake_up").status == 200
    thread.join(60)
    assert held and held[0].status == 200, held
    for conn in conns:
        conn.close()


def test_a_full_queue_is_the_anthropic_sdks_overloaded_error(replica) -> None:
    """A full queue refuses a Messages request, whole or streamed, with Anthropic's 529: the SDK
    raises ``OverloadedError`` (and would retry it after Retry-After), not ``RateLimitError``,
    which Anthropic keeps for one account's rate limits."""
    conns, thread, held = _asleep_holding(replica, LIMIT)
    try:
        client = anthropic.Anthropic(base_url=replica.url, api_key="x", max_retries=0, timeout=30)
        ask = {"model": replica.model_name, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        for stream in (False, True):
            with pytest.raises(anthropic.OverloadedError) as e:
                client.messages.create(**ask, stream=stream)
            assert e.value.status_code == 529 and e.value.response.headers["retry-after"] == "1"
            assert e.value.body["error"]["type"] == "overloaded_error", e.value.body
            assert e.value.body["error"]["message"].startswith("Server is overloaded:"), e.value.body
    finally:
        _wake(conns, thread, held)
