"""A replica that ends a stream with an error event saying it could not finish (its engine process
died: the 503 ``service_unavailable`` event an API server sends before ``[DONE]``) is failed over
like a replica that died: the client's stream goes on on another replica, resumed after the tokens
it has, with no error in it; the failure counts against the replica, not as a success. Errors the
client caused (a 408 timeout, a 4xx) end the stream as the replica sent them, and a stream that
cannot be resumed (``n`` = 2) ends with the replica's own error event.

The replicas are scripted (``scripted_replica.py``) and send the exact error frames ferry's server
builds (``server.streaming.sse_error_frame``, ``server.anthropic_protocol.error_body``, the
Responses stream's end): both replicas play the same script, so whichever one the policy picks
first dies and the other resumes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from router_harness import Cluster, Proc, metric, replicas_view, wait_until
from scripted_replica import DONE, ScriptedReplica, named_event, text_chunk

from server.anthropic_protocol import REQUEST_TIMEOUT_HEADER, error_response
from server.anthropic_protocol import error_body as anthropic_error_body
from server.errors import timeout_error, unavailable
from server.streaming import sse_error_frame

ENGINE_GONE = unavailable("The engine cannot serve requests: the engine process is gone")
DONE_EVENT = b"data: [DONE]\n\n"


def _completions(body: dict) -> list[bytes | str]:
    if body.get("resume"):
        return [text_chunk("c", 9, "length"), DONE_EVENT, DONE]
    end = {"engine-dies": ENGINE_GONE, "times-out": timeout_error(5)}[body["prompt"]]
    return [text_chunk("a", 7), text_chunk("b", 8), sse_error_frame(end), DONE_EVENT, DONE]


def _group(ids: list[int], events: list[dict]) -> bytes:
    return named_event("ferry_chunk", {"type": "ferry_chunk", "token_ids": ids, "events": events})


def _messages(body: dict) -> list[bytes | str]:
    start = {"type": "message_start", "message": {"id": "msg_1", "type": "message", "content": []}}
    delta = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta"}}
    block = {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    if body.get("resume"):
        return [
            named_event("message_start", start),
            _group([9], [block, {**delta, "delta": {"type": "text_delta", "text": "c"}}]),
            named_event("content_block_stop", {"type": "content_block_stop", "index": 0}),
            named_event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": "max_tokens"},
                    "usage": {"output_tokens": 1},
                },
            ),
            named_event("message_stop", {"type": "message_stop"}),
            DONE,
        ]
    return [
        named_event("message_start", start),
        _group([7], [block, {**delta, "delta": {"type": "text_delta", "text": "a"}}]),
        _group([8], [{**delta, "delta": {"type": "text_delta", "text": "b"}}]),
        named_event("error", anthropic_error_body(ENGINE_GONE)),
        DONE,
    ]


def _responses(body: dict) -> list[bytes | str]:
    item = {"id": "msg_1", "type": "message", "role": "assistant", "status": "in_progress", "content": []}
    at = {"output_index": 0, "content_index": 0, "item_id": "msg_1"}
    closing = [
        {"type": "response.output_text.done", **at, "text": "abc"},
        {"type": "response.content_part.done", **at, "part": {"type": "output_text", "text": "abc"}},
        {"type": "response.output_item.done", "output_index": 0, "item": {**item, "status": "completed"}},
    ]
    response = {"id": "resp_1", "object": "response", "created_at": 1, "status": "in_progress", "output": []}
    if body.get("resume"):
        completed = {"type": "response.completed", "response": {**response, "status": "completed"}}
        return [
            _group([9], [{"type": "response.output_text.delta", **at, "delta": "c"}, *closing, completed]),
            DONE,
        ]
    failed = {**response, "status": "failed", "error": {"code": "service_unavailable"}}
    return [
        named_event("response.created", {"type": "response.created", "response": response}),
        named_event("response.in_progress", {"type": "response.in_progress", "response": response}),
        _group(
            [7],
            [
                {"type": "response.output_item.added", "output_index": 0, "item": item},
                {"type": "response.content_part.added", **at, "part": {"type": "output_text", "text": ""}},
                {"type": "response.output_text.delta", **at, "delta": "a"},
            ],
        ),
        _group([8], [{"type": "response.output_text.delta", **at, "delta": "b"}]),
        *(named_event(e["type"], e) for e in closing),
        named_event("error", {"type": "error", "code": ENGINE_GONE.code, "message": ENGINE_GONE.message}),
        named_event("response.failed", {"type": "response.failed", "response": failed}),
        DONE,
    ]


SCRIPTS = {"/v1/completions": _completions, "/v1/messages": _messages, "/v1/responses": _responses}


def _script(path: str, body: dict) -> list[bytes | str]:
    return SCRIPTS[path](body)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[ScriptedReplica], Proc]]:
    replicas = [ScriptedReplica(), ScriptedReplica()]
    for r in replicas:
        r.script_for = _script
    cluster = Cluster(Path("unused"), tmp_path_factory.mktemp("router"))
    router = cluster.router(
        "--replica", replicas[0].url, "--replica", replicas[1].url, "--policy", "round_robin",
        "--circuit-failures", "100",
    )  # fmt: skip
    assert wait_until(lambda: all(v["routable"] for v in replicas_view(router).values()), 60)
    yield replicas, router
    cluster.close()
    for r in replicas:
        r.close()


def _events(router: Proc, path: str, body: dict, request_id: str | None = None) -> list[bytes]:
    headers = {"x-request-id": request_id} if request_id else {}
    with httpx.stream("POST", router.url + path, json=body, headers=headers, timeout=20) as r:
        assert r.status_code == 200
        return [e for e in r.read().split(b"\n\n") if e]


def _bodies(replicas: list[ScriptedReplica]) -> list[dict]:
    """The bodies the replicas got since the last call, a resumed request's after the one it resumes
    (round robin may have sent either to either replica, as the tests before this one left it)."""
    out = [b for r in replicas for b in r.bodies]
    for r in replicas:
        r.bodies.clear()
    return sorted(out, key=lambda b: "resume" in b)


def _counts(router: Proc) -> tuple[float, float]:
    return (
        metric(router.url, "ferry:router_failovers_total"),
        metric(router.url, "ferry:router_requests_total", {"status": "broken"}),
    )


def test_an_engine_death_error_event_is_failed_over_and_resumed(setup) -> None:
    replicas, router = setup
    failovers, broken = _counts(router)
    body = {"model": "m", "prompt": "engine-dies", "stream": True, "max_tokens": 3}
    events = _events(router, "/v1/completions", body, "engine-dies-1")
    assert events[-1] == b"data: [DONE]"
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    assert [c["choices"][0]["text"] for c in chunks] == ["a", "b", "c"]  # no error event among them
    assert {c["id"] for c in chunks} == {"cmpl-1"}
    first, resumed = _bodies(replicas)
    assert "resume" not in first and resumed["resume"] == {"token_ids": [7, 8]}
    # A failure of the replica that sent the error, not a 200 success; the failover is logged.
    assert _counts(router) == (failovers + 1, broken + 1)
    line = "request engine-dies-1: stream from http://127.0.0.1:"
    logged = [ln for ln in router.log.read_text().splitlines() if line in ln]
    assert len(logged) == 1
    assert "sent an error event after 2 tokens; resumed on another replica (failover 1 of 2)" in logged[0]


def test_a_client_caused_error_event_ends_the_stream_as_sent(setup) -> None:
    replicas, router = setup
    failovers, broken = _counts(router)
    body = {"model": "m", "prompt": "times-out", "stream": True, "max_tokens": 3}
    events = _events(router, "/v1/completions", body)
    assert events[-1] == b"data: [DONE]"
    error = json.loads(events[-2].removeprefix(b"data: "))["error"]
    assert (error["type"], error["code"]) == ("TimeoutError", "request_timeout")
    assert len(_bodies(replicas)) == 1 and _counts(router) == (failovers, broken)


def test_an_unresumable_stream_ends_with_the_replicas_own_error(setup) -> None:
    replicas, router = setup
    failovers, _ = _counts(router)
    body = {"model": "m", "prompt": "engine-dies", "stream": True, "max_tokens": 3, "echo": True}
    events = _events(router, "/v1/completions", body)
    assert events[-1] == b"data: [DONE]"
    error = json.loads(events[-2].removeprefix(b"data: "))["error"]
    assert error == json.loads(ENGINE_GONE.body().model_dump_json())["error"]
    assert len(_bodies(replicas)) == 1 and _counts(router)[0] == failovers


def test_a_messages_stream_whose_engine_died_is_resumed(setup) -> None:
    replicas, router = setup
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    events = [json.loads(e.split(b"data: ", 1)[1]) for e in _events(router, "/v1/messages", body)]
    kinds = [e["type"] for e in events]
    assert kinds == [
        "message_start", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_delta", "content_block_stop", "message_delta", "message_stop",
    ]  # fmt: skip
    assert "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta") == "abc"
    assert events[-2]["usage"]["output_tokens"] == 3
    assert _bodies(replicas)[1]["resume"] == {"token_ids": [7, 8]}


def test_a_responses_stream_whose_engine_died_is_resumed(setup) -> None:
    replicas, router = setup
    body = {"model": "m", "input": "hi", "stream": True}
    events = [json.loads(e.split(b"data: ", 1)[1]) for e in _events(router, "/v1/responses", body)]
    kinds = [e["type"] for e in events]
    assert "error" not in kinds and "response.failed" not in kinds
    assert kinds[-1] == "response.completed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert deltas == ["a", "b", "c"]
    # Resumed with the item as the client has it: still open, with the text it was sent.
    resume = _bodies(replicas)[1]["resume"]
    assert resume["token_ids"] == [7, 8]
    assert resume["output"][0]["content"][0]["text"] == "ab"
    assert resume["output"][0]["status"] == "in_progress"


def test_a_decode_worker_whose_engine_died_is_failed_over(tmp_path: Path) -> None:
    # Prefill/decode: the decode worker's stream is relayed by the same pump; its engine's death
    # is resumed on the other decode worker after every token sent (the prefill's first included).
    prefill, decode = ScriptedReplica(), [ScriptedReplica(), ScriptedReplica()]
    choice = {"index": 0, "text": "a", "token_ids": [7], "finish_reason": "length"}
    prefill.whole = {
        "id": "cmpl-p", "created": 1, "model": "m", "choices": [choice],
        "usage": {"prompt_tokens": 4}, "kv_transfer": {"block_hashes": []},
    }  # fmt: skip

    def script(path: str, body: dict) -> list[bytes | str]:
        if body["resume"]["token_ids"] == [7]:  # the hand-off
            return [text_chunk("b", 8), sse_error_frame(ENGINE_GONE), DONE_EVENT, DONE]
        return [text_chunk("c", 9, "length"), DONE_EVENT, DONE]

    for d in decode:
        d.script_for = script
    cluster = Cluster(tmp_path, tmp_path)
    try:
        router = cluster.router(
            "--prefill", prefill.url, "--decode", decode[0].url, "--decode", decode[1].url,
            "--pd-threshold", "0", "--policy", "round_robin",
        )  # fmt: skip
        assert wait_until(lambda: all(v["routable"] for v in replicas_view(router).values()), 60)
        body = {"model": "m", "prompt": "hello", "stream": True, "max_tokens": 3}
        events = _events(router, "/v1/completions", body)
        assert events[-1] == b"data: [DONE]"
        chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
        assert [c["choices"][0]["text"] for c in chunks] == ["a", "b", "c"]
        assert sorted(b["resume"]["token_ids"] for b in _bodies(decode)) == [[7], [7, 8]]
        assert metric(router.url, "ferry:router_failovers_total") == 1
    finally:
        cluster.close()
        prefill.close()
        for d in decode:
            d.close()


def _retries(router: Proc) -> float:
    return metric(router.url, "ferry:router_retries_total")


def test_a_messages_request_timeout_is_the_answer_not_retried(setup) -> None:
    """A replica's Messages API answer to a request past its ``--request-timeout`` (Anthropic's 504
    ``timeout_error``, marked as the request's own) is relayed as it is, from the one replica that
    ran it: another would run it as long again. A 504 without the mark (a gateway's) is retried."""
    replicas, router = setup
    timed_out = error_response(timeout_error(5), "req_t")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    _bodies(replicas)
    try:
        for r in replicas:
            r.whole = json.loads(timed_out.body)
            r.whole_status = b"504 Gateway Timeout"
            r.whole_headers = [(REQUEST_TIMEOUT_HEADER.encode(), b"1")]
        retries = _retries(router)
        answer = httpx.post(router.url + "/v1/messages", json=body, timeout=20)
        assert answer.status_code == 504 and answer.headers[REQUEST_TIMEOUT_HEADER] == "1"
        assert answer.json()["error"] == {"type": "timeout_error", "message": timeout_error(5).message}
        assert len(_bodies(replicas)) == 1 and _retries(router) == retries
        for r in replicas:  # a gateway's 504: the replica did not answer, the other one may
            r.whole_headers = []
        answer = httpx.post(router.url + "/v1/messages", json=body, timeout=20)
        assert answer.status_code == 504 and len(_bodies(replicas)) == 2
        assert _retries(router) == retries + 1
    finally:
        for r in replicas:
            r.whole = {"id": "w", "choices": [{"index": 0, "text": "whole"}]}
            r.whole_status, r.whole_headers = b"200 OK", []
