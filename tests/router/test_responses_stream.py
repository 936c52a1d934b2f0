"""A Responses stream spliced across replicas, event by event: a replica's translation of chat
chunks (``server/responses_stream.py``, grouped with token ids and resumed from what the client
has) through the router's tracker (``router/responses_stream.py``), checked by the official SDK's
stream accumulator, as a client would. The kinds of items a replica can be writing when it dies:
reasoning, a message, a function call; and the stream that cannot go on."""

from __future__ import annotations

import asyncio
import json

import pytest
from openai import omit
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from router.responses_stream import ResponsesTracker
from router.sse import SSESplitter
from server.chat_protocol import (
    ChatCompletionChunk,
    ChatLogprobs,
    ChatStreamChoice,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    TokenLogprob,
)
from server.errors import APIError
from server.protocol import UsageInfo
from server.reasoning_tokens import count_thought
from server.responses_object import _Response
from server.responses_protocol import ResponsesRequest, ResponsesResume
from server.responses_stream import events

START, END = 8, 9  # <think>'s and </think>'s token ids in the reasoning_tokens tests


def chunk(
    ids: list[int], finish: str | None = None, logprobs: list | None = None, **delta
) -> ChatCompletionChunk:
    choice = ChatStreamChoice(
        index=0,
        delta=DeltaMessage(**delta),
        finish_reason=finish,
        token_ids=ids,
        logprobs=ChatLogprobs(content=logprobs) if logprobs is not None else None,
    )
    return ChatCompletionChunk(id="c", created=0, model="m", choices=[choice])


def usage(completion: int) -> ChatCompletionChunk:
    info = UsageInfo(prompt_tokens=5, completion_tokens=completion, total_tokens=5 + completion)
    return ChatCompletionChunk(id="c", created=0, model="m", choices=[], usage=info)


def call(index: int, arguments: str, name: str | None = None) -> list[DeltaToolCall]:
    fn = DeltaFunctionCall(name=name, arguments=arguments)
    return [DeltaToolCall(index=index, id="call_1" if name else None, function=fn)]


def replica(
    chunks: list[ChatCompletionChunk],
    resume: dict | None = None,
    logprobs: bool = False,
    tools: list[dict] | None = None,
    fail: Exception | None = None,
    summary: bool = False,
    opened: bool | None = None,
) -> tuple[list[bytes], _Response]:
    """A replica's SSE events for ``chunks`` (grouped, as a router asks), and the response it built;
    ``fail``: raised by the chat stream after its chunks (its engine failed part-way)."""
    req = ResponsesRequest(
        input="x",
        tools=tools,
        stream=True,
        return_token_ids=True,
        resume=ResponsesResume(**resume) if resume is not None else None,
        reasoning={"summary": "auto"} if summary else None,
    )
    built = _Response(req, "m", "rid", store=True)
    if opened is not None:  # a <think> parser's count (<think> 8, </think> 9); opened: by the prompt
        built.count_reasoning = lambda ids: count_thought(ids, [START], [END], opened)

    async def source():
        for c in chunks:
            yield c
        if fail is not None:
            raise fail

    async def save() -> None:
        pass

    async def run() -> list[bytes]:
        resumed = req.resume.output if req.resume is not None else None
        stream = events(built, source(), save, want_logprobs=logprobs, grouped=True, resumed=resumed)
        return SSESplitter().feed(b"".join([f async for f in stream]))

    return asyncio.run(run()), built


def parse(sent: bytes) -> list[dict]:
    """Events as the client reads them (each event's name checked against its data's type)."""
    out = []
    for one in SSESplitter().feed(sent + b"\n\n"):
        head, data = one.split(b"\n", 1)
        obj = json.loads(data[len(b"data: ") :])
        assert head == b"event: " + obj["type"].encode()
        out.append(obj)
    return out


def relay(tracker: ResponsesTracker, frames: list[bytes]) -> list[dict]:
    return [e for frame in frames for e in parse(tracker.process(frame) or b"")]


def splice(
    first: list[ChatCompletionChunk],
    dies_after: int,
    second: list[ChatCompletionChunk],
    logprobs: bool = False,
    summary: bool = False,
    opened: bool | None = None,
):
    """The client's events when the first replica dies after ``dies_after`` SSE events and the
    second resumes from what the router was given; and what the second replica built."""
    tracker = ResponsesTracker()
    frames, _ = replica(first, logprobs=logprobs, summary=summary)
    sent = relay(tracker, frames[:dies_after])
    assert not tracker.done  # it died part-way
    tracker.begin_failover()
    resume = tracker.resume_body({"input": "x"})["resume"]
    frames, built = replica(second, resume, logprobs, summary=summary, opened=opened)
    return sent + relay(tracker, frames), tracker, built


def sdk_final(client_events: list[dict]):
    """The response the SDK's stream helper assembles (it raises on events it cannot accept)."""
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for e in client_events:
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=e))
    return state._completed_response


def test_a_resumed_reasoning_item_goes_on_then_its_message_opens() -> None:
    first = [chunk([1], reasoning_content="a"), chunk([2], reasoning_content="b")]
    # The resumed replica's reasoning goes on, then its answer: the message is the next item.
    second = [chunk([3], reasoning_content="c"), chunk([4], content="Hi"), chunk([5], "stop"), usage(3)]
    # created, in_progress, then groups: [added + delta "a"], [delta "b"]
    client, tracker, built = splice(first, 4, second)
    assert tracker.token_ids == [1, 2, 3, 4, 5] and tracker.done
    assert [e["sequence_number"] for e in client] == list(range(len(client)))
    kinds = [e["type"] for e in client]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",  # "c": the same item
        "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    reasoning_id = client[2]["item"]["id"]
    assert {e["item_id"] for e in client if e["type"] == "response.reasoning_text.delta"} == {reasoning_id}
    assert client[6]["text"] == "abc" and client[8]["output_index"] == 1
    final = sdk_final(client)
    assert final.id == "resp_rid" and [i.type for i in final.output] == ["reasoning", "message"]
    assert final.output[0].id == reasoning_id and final.output[0].content[0].text == "abc"
    assert final.output_text == "Hi" and final.usage.output_tokens == 5 and final.usage.total_tokens == 10
    # What the resumed replica stores: the whole response.
    assert built.body()["output"] == client[-1]["response"]["output"]


def test_a_stream_resumed_twice_is_still_one_response() -> None:
    tracker = ResponsesTracker()
    frames, _ = replica([chunk([1], content="a"), chunk([2], content="b")])
    client = relay(tracker, frames[:4])
    tracker.begin_failover()
    # The second replica dies too, after one more token.
    frames, _ = replica([chunk([3], content="c"), chunk([4], content="d")], tracker.resume_body({})["resume"])
    client += relay(tracker, frames[:1])
    tracker.begin_failover()
    resume = tracker.resume_body({})["resume"]
    assert resume["token_ids"] == [1, 2, 3] and resume["output"][0]["content"][0]["text"] == "abc"
    frames, built = replica([chunk([4], content="d"), chunk([5], "stop"), usage(2)], resume)
    client += relay(tracker, frames)
    assert [e["sequence_number"] for e in client] == list(range(len(client)))
    final = sdk_final(client)
    assert final.output_text == "abcd" and len(final.output) == 1 and final.usage.output_tokens == 5
    assert built.body()["output"] == client[-1]["response"]["output"]


def test_an_open_message_is_closed_when_the_resumed_text_is_a_call() -> None:
    first = [chunk([1], content="Let me "), chunk([2], content="see")]
    second = [
        chunk([3, 4], tool_calls=call(0, '{"tz": "UTC"}', name="now")),
        chunk([], "tool_calls"),
        usage(2),
    ]
    client, _, _ = splice(first, 4, second)
    kinds = [e["type"] for e in client]
    # The message's done events the dead replica never sent, with its whole text, then the call.
    at = kinds.index("response.output_text.done")
    assert client[at]["text"] == "Let me see" and kinds[at + 3] == "response.output_item.added"
    assert client[at + 3]["output_index"] == 1 and client[at + 3]["item"]["type"] == "function_call"
    final = sdk_final(client)
    assert [i.type for i in final.output] == ["message", "function_call"]
    assert final.output_text == "Let me see" and final.output[1].arguments == '{"tz": "UTC"}'
    assert final.output[1].call_id == "call_1"


def test_logprobs_of_a_resumed_message_are_the_whole_answers() -> None:
    def lp(token: str) -> list[TokenLogprob]:
        return [TokenLogprob(token=token, logprob=-1.0)]

    first = [chunk([1], content="a", logprobs=lp("a")), chunk([2], content="b", logprobs=lp("b"))]
    second = [chunk([3], content="c", logprobs=lp("c")), chunk([], "stop"), usage(1)]
    client, _, built = splice(first, 4, second, logprobs=True)
    done = next(e for e in client if e["type"] == "response.output_text.done")
    assert [t["token"] for t in done["logprobs"]] == ["a", "b", "c"] and done["text"] == "abc"
    final = sdk_final(client)
    assert [t.token for t in final.output[0].content[0].logprobs] == ["a", "b", "c"]
    assert built.body()["output"][0]["content"][0]["logprobs"] == done["logprobs"]


def test_a_resumed_function_call_goes_on_in_the_same_item() -> None:
    first = [
        chunk([1], tool_calls=call(0, '{"story": "Once', name="tell")),
        chunk([2], tool_calls=call(0, " upon")),
    ]
    # A named call resumed: its deltas come without id or name (the client has them).
    second = [chunk([3], tool_calls=call(0, ' a time"}')), chunk([4], "stop"), usage(2)]
    client, _, _ = splice(first, 4, second)
    added = [e for e in client if e["type"] == "response.output_item.added"]
    assert len(added) == 1
    deltas = {e["item_id"] for e in client if e["type"] == "response.function_call_arguments.delta"}
    assert deltas == {added[0]["item"]["id"]}
    final = sdk_final(client)
    (item,) = final.output
    assert (
        item.arguments == '{"story": "Once upon a time"}' and item.name == "tell" and item.call_id == "call_1"
    )
    assert final.usage.output_tokens == 4


def test_text_after_a_call_is_the_next_item_and_goes_on_there() -> None:
    """Text after a call closes the call and takes the next output index (not the call's), also
    when a resumed replica continues it."""
    first = [chunk([1], tool_calls=call(0, "{}", name="now")), chunk([2], content="x")]
    client, _, built = splice(first, 4, [chunk([3], content="y"), chunk([4], "stop"), usage(2)])
    added = [
        (e["output_index"], e["item"]["type"]) for e in client if e["type"] == "response.output_item.added"
    ]
    assert added == [(0, "function_call"), (1, "message")]
    assert {e["output_index"] for e in client if e["type"] == "response.output_text.delta"} == {1}
    final = sdk_final(client)
    assert [i.type for i in final.output] == ["function_call", "message"] and final.output_text == "xy"
    assert [i["type"] for i in built.output] == ["function_call", "message"]


def test_a_death_before_the_first_token_resumes_without_a_second_opening() -> None:
    client, tracker, _ = splice(
        [chunk([1], content="a")], 2, [chunk([1], content="a"), chunk([2], "stop"), usage(2)]
    )
    kinds = [e["type"] for e in client]
    assert kinds.count("response.created") == 1 and kinds[-1] == "response.completed"
    assert sdk_final(client).output_text == "a" and tracker.token_ids == [1, 2]


def test_the_last_token_travels_with_the_end_of_the_response() -> None:
    frames, _ = replica([chunk([1], content="a"), chunk([2], "length", content="b"), usage(2)])
    last = json.loads(frames[-1].split(b"data: ", 1)[1])
    assert last["type"] == "ferry_chunk" and last["token_ids"] == [2]
    assert [e["type"] for e in last["events"]][0] == "response.output_text.delta"
    assert [e["type"] for e in last["events"]][-1] == "response.incomplete"


def test_a_stream_that_cannot_go_on_ends_failed_with_what_the_client_has() -> None:
    tracker = ResponsesTracker()
    frames, _ = replica([chunk([1], content="Hel"), chunk([2], content="lo"), chunk([3], "stop"), usage(3)])
    client = relay(tracker, frames[:4])
    client += parse(tracker.error_event("gone"))
    # The open message is closed, incomplete, before the error (as a failing replica closes it).
    assert [e["type"] for e in client][-5:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "error",
        "response.failed",
    ]
    assert client[-5]["text"] == "Hello" and client[-4]["part"]["text"] == "Hello"
    assert (
        client[-3]["item"]["status"] == "incomplete" and client[-3]["item"]["id"] == client[2]["item"]["id"]
    )
    assert [e["sequence_number"] for e in client] == list(range(len(client)))
    failed = client[-1]["response"]
    assert failed["id"] == "resp_rid" and failed["status"] == "failed"
    assert failed["output"] == [client[-3]["item"]]
    assert failed["output"][0]["content"][0]["text"] == "Hello"
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for e in client:  # accepted, with no completed response to give
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=e))
    assert state._completed_response is None


def _lp(token: str) -> list[TokenLogprob]:
    return [TokenLogprob(token=token, logprob=-0.5)]


@pytest.mark.parametrize(
    "chunks",
    [
        [chunk([1], content="Hel", logprobs=_lp("Hel")), chunk([2], content="lo", logprobs=_lp("lo"))],
        [chunk([1], reasoning_content="a"), chunk([2], reasoning_content="b")],
        [chunk([1], reasoning_content="a"), chunk([2], reasoning_content="b")],
        # A message done, then a named call whose arguments were cut.
        [
            chunk([1], content="x", logprobs=_lp("x")),
            chunk([2], tool_calls=call(0, '{"story": "Once', name="tell")),
            chunk([3], tool_calls=call(0, " upon")),
        ],
    ],
    ids=["message", "reasoning", "summary", "call"],
)
def test_the_routers_end_of_a_stream_closes_its_items_as_a_failing_replica_does(chunks, request) -> None:
    """A replica whose engine fails part-way closes the open items ``incomplete`` before its error
    and ``response.failed``; the router's own end of a stream it cannot resume (the replica died
    without a word) says the same of the same items."""
    summary = request.node.callspec.id == "summary"  # the thought as the item's summary
    gone = APIError(503, "engine gone", code="service_unavailable")
    frames, _ = replica(chunks, logprobs=True, fail=gone, summary=summary)
    grouped = [i for i, f in enumerate(frames) if f.startswith(b"event: ferry_chunk")]
    replicas_end = ResponsesTracker()
    said = relay(replicas_end, frames)
    said += parse((replicas_end.failure_end() or b"").rstrip(b"\n"))
    routers_end = ResponsesTracker()
    died = relay(routers_end, frames[: grouped[-1] + 1])  # died after its last chunk
    died += parse(routers_end.error_event("gone"))
    assert len(died) == len(said) and [e["sequence_number"] for e in died] == list(range(len(died)))

    def ending(events: list[dict]) -> list[dict]:
        return [{k: v for k, v in e.items() if k != "sequence_number"} for e in events[:-2]]

    assert ending(died) == ending(said)
    assert [e["type"] for e in died[-2:]] == [e["type"] for e in said[-2:]] == ["error", "response.failed"]
    assert died[-1]["response"]["output"] == said[-1]["response"]["output"]
    statuses = [item["status"] for item in died[-1]["response"]["output"]]
    assert statuses == (["completed", "incomplete"] if len(chunks) == 3 else ["incomplete"])
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for e in died:
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=e))


def test_text_from_a_replica_that_does_not_group_cannot_be_resumed() -> None:
    tracker = ResponsesTracker()
    delta = {"type": "response.output_text.delta", "item_id": "m", "output_index": 0, "content_index": 0}
    relay(tracker, [f"event: x\ndata: {json.dumps({**delta, 'delta': 'a'})}".encode()])
    assert not tracker.ids_complete and tracker.token_ids == []


def test_an_open_call_is_closed_with_its_name_when_the_stream_cannot_go_on() -> None:
    tracker = ResponsesTracker()
    first = [
        chunk([1], tool_calls=call(0, '{"story": "Once', name="tell")),
        chunk([2], tool_calls=call(0, " upon")),
    ]
    frames, _ = replica([*first, chunk([3], "stop"), usage(3)])
    client = relay(tracker, frames[:3])  # the call's first piece relayed, then the replica is gone
    client += parse(tracker.error_event("gone"))
    done = [e for e in client if e["type"] == "response.function_call_arguments.done"]
    assert [(e["name"], e["arguments"]) for e in done] == [("tell", '{"story": "Once')]


def test_a_resumed_summary_goes_on_in_the_same_item_and_its_tokens_are_counted() -> None:
    """With ``reasoning.summary`` the thought streams as the reasoning item's summary (OpenAI's
    summary part and text events); a stream resumed mid-thought goes on in the same summary part, and
    usage counts the whole answer's tokens (the resumed ones too) up to </think> as reasoning."""
    first = [chunk([1], reasoning_content="a"), chunk([2], reasoning_content="b")]
    second = [
        chunk([3], reasoning_content="c"),
        chunk([END]),
        chunk([4], content="Hi"),
        chunk([5], "stop"),
        usage(4),
    ]
    client, tracker, built = splice(first, 4, second, summary=True, opened=True)
    kinds = [e["type"] for e in client]
    assert kinds[:11] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.reasoning_summary_part.added",
        "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.delta",  # "c": the same item and part
        "response.reasoning_summary_text.done",
        "response.reasoning_summary_part.done",
        "response.output_item.done",
        "response.output_item.added",
    ]
    assert client[2]["item"] == {
        "type": "reasoning",
        "id": client[2]["item"]["id"],
        "summary": [],
        "status": "in_progress",
    }
    assert [client[i]["summary_index"] for i in range(3, 9)] == [0] * 6
    assert client[8]["part"] == {"type": "summary_text", "text": "abc"} and "status" not in client[8]
    final = sdk_final(client)
    assert [s.model_dump() for s in final.output[0].summary] == [{"type": "summary_text", "text": "abc"}]
    assert final.output[0].content is None and final.output_text == "Hi"
    # The prompt opened the thought: 2 resumed tokens and "c"'s; </think>, "Hi" and the end are not.
    assert final.usage.output_tokens_details.reasoning_tokens == 3
    assert built.body()["output"] == client[-1]["response"]["output"]


ONE_EACH = [
    chunk([START]),
    chunk([1], reasoning_content="a"),
    chunk([2], reasoning_content="b"),
    chunk([END]),
    chunk([3], content="Hi"),
    chunk([4], "stop"),
]


@pytest.mark.parametrize(
    ("chunks", "opened", "expected"),
    [
        # vLLM's count: the tokens inside <think> ... </think>, the markers not counted.
        (ONE_EACH, False, 2),
        # The same ids read together (the engine's outputs in one chunk): the same count.
        ([chunk([START, 1, 2, END], reasoning_content="ab"), chunk([3, 4], "stop", content="Hi")], False, 2),
        ([chunk([START, 1, 2, END, 3], content="Hi", reasoning_content="ab"), chunk([4], "stop")], False, 2),
        # The prompt opened the thought: from the first token.
        ([chunk([1, 2, END], reasoning_content="ab"), chunk([3, 4], "stop", content="Hi")], True, 2),
        # Never closed (cut): all of it, a token with no text yet too.
        (
            [
                chunk([1], reasoning_content="a"),
                chunk([2]),
                chunk([3], reasoning_content="<b"),
                chunk([4], "length"),
            ],
            True,
            4,
        ),
        # No thought at all (thinking off: the prompt did not open it, the answer does not).
        ([chunk([1], content="Hi"), chunk([2], "stop")], False, 0),
    ],
    ids=["one-each", "marker-last", "marker-inside", "prompt-opened", "cut", "none"],
)
def test_reasoning_tokens_are_the_thoughts_tokens(chunks, opened: bool, expected: int) -> None:
    n = sum(len(c.choices[0].token_ids) for c in chunks)
    _, built = replica([*chunks, usage(n)], opened=opened)
    assert built.usage["output_tokens_details"] == {"reasoning_tokens": expected}
