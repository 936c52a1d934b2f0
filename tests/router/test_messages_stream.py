"""The Messages API's stream tracker (``router/messages_stream.py``), event by event: what the
client gets from a replica's grouped events, and how a resumed replica's events are spliced in."""

from __future__ import annotations

import asyncio
import json

import pytest

from router.http import send_error
from router.messages_stream import GROUP_EVENT, MessagesTracker, anthropic_errors
from router.retry import RetryPolicy, counts_as_replica_failure
from server.serving_messages import GROUP_EVENT as SERVER_GROUP_EVENT


def frame(obj: dict) -> bytes:
    return f"event: {obj['type']}\ndata: {json.dumps(obj)}".encode()


def group(ids: list[int], *events: dict) -> bytes:
    return frame({"type": GROUP_EVENT, "token_ids": ids, "events": list(events)})


def start(index: int, kind: str, **extra) -> dict:
    return {"type": "content_block_start", "index": index, "content_block": {"type": kind, **extra}}


def delta(index: int, **payload) -> dict:
    return {"type": "content_block_delta", "index": index, "delta": payload}


def stop(index: int) -> dict:
    return {"type": "content_block_stop", "index": index}


def relayed(tracker: MessagesTracker, *events: bytes) -> list[dict]:
    """The events the client gets, parsed (event name checked against the data's type)."""
    out = []
    for event in events:
        sent = tracker.process(event)
        if sent is None:
            continue
        for one in sent.split(b"\n\n"):
            head, data = one.split(b"\n", 1)
            obj = json.loads(data[len(b"data: ") :])
            assert head == b"event: " + obj["type"].encode()
            out.append(obj)
    return out


MESSAGE_START = frame({"type": "message_start", "message": {"id": "msg_1", "usage": {"input_tokens": 5}}})


def test_the_server_and_the_router_name_the_group_event_alike() -> None:
    assert GROUP_EVENT == SERVER_GROUP_EVENT


def test_groups_are_unpacked_and_their_ids_kept_from_the_client() -> None:
    t = MessagesTracker()
    out = relayed(
        t,
        MESSAGE_START,
        group([11, 12], start(0, "thinking", thinking=""), delta(0, type="thinking_delta", thinking="hm")),
        group([13], stop(0), start(1, "text", text=""), delta(1, type="text_delta", text="Hi")),
        group([14]),  # a chunk whose text is held back: ids only, nothing for the client
    )
    assert [e["type"] for e in out] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
    ]
    assert t.token_ids == [11, 12, 13, 14] and t.ids_complete and t.saw_token_ids_field
    assert t.open_block == (1, "text") and t.content_choices == 2
    assert not any("token_ids" in e for e in out)


def test_a_resumed_text_block_continues_the_open_one() -> None:
    t = MessagesTracker()
    relayed(
        t, MESSAGE_START, group([1, 2], start(0, "text", text=""), delta(0, type="text_delta", text="ab"))
    )
    t.begin_failover()
    assert t.resume_body({"model": "m", "stream": True}) == {
        "model": "m",
        "stream": True,
        "resume": {"token_ids": [1, 2]},
    }
    out = relayed(
        t,
        MESSAGE_START,  # the resumed replica's own opening: dropped
        group([3], start(0, "text", text=""), delta(0, type="text_delta", text="c")),
        group([4], stop(0)),
        frame(
            {"type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": 2}}
        ),
        frame({"type": "message_stop"}),
    )
    assert out == [
        delta(0, type="text_delta", text="c"),
        stop(0),
        {"type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": 4}},
        {"type": "message_stop"},
    ]
    assert t.finished and t.done and t.open_block is None


def test_a_resumed_streams_message_delta_keeps_the_input_counts_the_client_was_told() -> None:
    """A message_delta's input counts are cumulative (Anthropic's, the SDK's ``MessageDeltaUsage``):
    after a failover they stay those of the message_start the client got, not the resumed
    replica's own split of the prompt into computed and cached tokens; the output is the whole
    answer's."""
    t = MessagesTracker()
    told = {
        "input_tokens": 3,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 16,
        "output_tokens": 0,
    }
    opening = frame({"type": "message_start", "message": {"id": "msg_1", "usage": told}})
    relayed(t, opening, group([1, 2], start(0, "text", text=""), delta(0, type="text_delta", text="ab")))
    t.begin_failover()
    resumed = {
        "input_tokens": 19,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": 3,
    }
    end = {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": resumed}
    out = relayed(
        t, opening, group([3], start(0, "text", text=""), delta(0, type="text_delta", text="c")), frame(end)
    )
    assert out[-1]["usage"] == {**told, "output_tokens": 3}


def test_a_resumed_block_of_another_kind_closes_the_open_one_and_takes_the_next_index() -> None:
    t = MessagesTracker()
    relayed(
        t,
        MESSAGE_START,
        group([1], start(0, "thinking", thinking=""), delta(0, type="thinking_delta", thinking="x")),
    )
    t.begin_failover()
    out = relayed(
        t, MESSAGE_START, group([2], start(0, "text", text=""), delta(0, type="text_delta", text="y"))
    )
    assert out == [stop(0), start(1, "text", text=""), delta(1, type="text_delta", text="y")]
    assert t.open_block == (1, "text")


def test_a_resumed_tool_call_goes_on_but_a_new_call_opens_a_block() -> None:
    t = MessagesTracker()
    call = start(0, "tool_use", id="call_1", name="f", input={})
    relayed(t, MESSAGE_START, group([1], call, delta(0, type="input_json_delta", partial_json='{"a"')))
    t.begin_failover()
    # The resumed call comes without its id and name (the client has them): the same block.
    resumed = start(0, "tool_use", id=None, name=None, input={})
    out = relayed(t, group([2], resumed, delta(0, type="input_json_delta", partial_json=": 1}")))
    assert out == [delta(0, type="input_json_delta", partial_json=": 1}")]
    # A second call, named, after another failover: a block of its own.
    t.begin_failover()
    second = start(1, "tool_use", id="call_2", name="g", input={})
    out = relayed(t, group([3], stop(0), second))
    assert out == [stop(0), start(1, "tool_use", id="call_2", name="g", input={})]


def test_a_replica_that_does_not_group_makes_the_stream_unresumable() -> None:
    t = MessagesTracker()
    out = relayed(
        t, MESSAGE_START, frame(start(0, "text", text="")), frame(delta(0, type="text_delta", text="a"))
    )
    assert [e["type"] for e in out] == ["message_start", "content_block_start", "content_block_delta"]
    assert not t.ids_complete and t.token_ids == []


def test_the_replicas_error_event_ends_the_stream() -> None:
    t = MessagesTracker()
    out = relayed(t, MESSAGE_START, frame({"type": "error", "error": {"type": "api_error", "message": "x"}}))
    assert out[-1]["type"] == "error" and t.done


def test_a_client_that_asks_for_token_ids_gets_them_as_pings() -> None:
    t = MessagesTracker(client_wants_token_ids=True)
    out = relayed(t, group([7, 8], start(0, "text", text=""), delta(0, type="text_delta", text="z")))
    assert out[-1] == {"type": "ping", "token_ids": [7, 8]}


def _collect(messages: list[dict]):
    async def send(message: dict) -> None:
        messages.append(message)

    return send


@pytest.mark.parametrize(
    ("status", "answered", "kind"),
    [
        # The router's capacity answers (no replica; its own queue full) are Anthropic's 529.
        (503, 529, "overloaded_error"),
        (429, 529, "overloaded_error"),
        (502, 502, "api_error"),
        (504, 504, "timeout_error"),
        (413, 413, "request_too_large"),
    ],
)
def test_router_errors_on_messages_routes_take_anthropics_shape(status, answered, kind) -> None:
    sent: list[dict] = []
    retry = [(b"retry-after", b"1")]
    asyncio.run(send_error(anthropic_errors(_collect(sent)), status, "no replica is available", retry))
    start, body = sent
    assert start["status"] == answered and (b"retry-after", b"1") in start["headers"]
    payload = json.loads(body["body"])
    assert payload == {"type": "error", "error": {"type": kind, "message": "no replica is available"}}
    assert dict(start["headers"])[b"content-length"] == str(len(body["body"])).encode()


def test_a_replicas_529_is_load_retried_elsewhere() -> None:
    """A replica's 529 on the Messages API (its full queue or its 503) is re-sent to another
    replica as its 429 would be, and counts as load, not as a failure of the replica."""
    assert RetryPolicy().should_retry_status(529, 0) and not counts_as_replica_failure(529)
    assert counts_as_replica_failure(503) and not counts_as_replica_failure(429)


def test_replica_answers_on_messages_routes_pass_unchanged() -> None:
    sent: list[dict] = []

    # A replica's answer in Anthropic's shape, in two body parts, passes unchanged; so does a 200.
    already = json.dumps(
        {"type": "error", "error": {"type": "invalid_request_error", "message": "m"}}
    ).encode()

    async def replica_answer() -> None:
        send = anthropic_errors(_collect(sent))
        await send({"type": "http.response.start", "status": 400, "headers": []})
        await send({"type": "http.response.body", "body": already[:10], "more_body": True})
        await send({"type": "http.response.body", "body": already[10:]})
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"event: ping", "more_body": True})

    asyncio.run(replica_answer())
    assert [m.get("status") for m in sent] == [400, None, 200, None]
    assert sent[1]["body"] == already and sent[3] == {
        "type": "http.response.body",
        "body": b"event: ping",
        "more_body": True,
    }


def test_messages_answers_name_their_request_in_anthropics_header_and_error_body() -> None:
    """The router's own error names its request (``request_id``, ``request-id``), as Anthropic's
    errors do; every answer's head carries ``request-id`` = its ``x-request-id`` (a replica's own
    ``request-id`` replaced, so the SDK's ``_request_id`` is the router's id)."""
    sent: list[dict] = []
    rid = [(b"x-request-id", b"r1")]
    asyncio.run(send_error(anthropic_errors(_collect(sent)), 401, "no key", rid))
    start, body = sent
    assert json.loads(body["body"])["request_id"] == "r1" and dict(start["headers"])[b"request-id"] == b"r1"
    sent.clear()
    head = {"type": "http.response.start", "status": 200, "headers": [*rid, (b"request-id", b"replica")]}
    asyncio.run(anthropic_errors(_collect(sent))(head))
    assert [v for k, v in sent[0]["headers"] if k == b"request-id"] == [b"r1"]


PING = frame({"type": "ping"})


def test_a_replica_that_sent_only_pings_is_resumed_with_the_next_ones_message_start() -> None:
    """A replica whose request waited (keep-alive pings only) and then died: the replica that
    takes the request over opens the message, as the client has no message_start yet; once it
    has one, a resumed replica's is dropped."""
    t = MessagesTracker()
    assert relayed(t, PING, PING) == [{"type": "ping"}, {"type": "ping"}]
    t.begin_failover()
    text = group([5], start(0, "text", text=""), delta(0, type="text_delta", text="Hi"))
    out = relayed(t, MESSAGE_START, PING, text)
    assert [e["type"] for e in out] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    t.begin_failover()
    out = relayed(
        t, MESSAGE_START, PING, group([6], start(0, "text", text=""), delta(0, type="text_delta", text="!"))
    )
    assert [e["type"] for e in out] == ["ping", "content_block_delta"] and out[1]["index"] == 0
