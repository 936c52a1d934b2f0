"""Stream bookkeeping for failover: token ids collected, stripped, spliced after a failover."""

from __future__ import annotations

import json

from router.sse import GenerateTracker, SSESplitter, StreamTracker


def ev(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode()


def chunk(
    content: str, ids: list[int], *, role: bool = False, finish: str | None = None, cid: str = "c1"
) -> bytes:
    delta = {"role": "assistant", "content": content} if role else {"content": content}
    choice = {"index": 0, "delta": delta, "finish_reason": finish, "token_ids": ids}
    return ev(
        {"id": cid, "object": "chat.completion.chunk", "created": 11, "model": "m", "choices": [choice]}
    )


def test_splitter_reassembles_events_across_network_chunks() -> None:
    s = SSESplitter()
    assert s.feed(b'data: {"a"') == []
    assert s.feed(b": 1}\n\ndata: [DO") == [b'data: {"a": 1}']
    assert s.feed(b"NE]\n\n") == [b"data: [DONE]"]
    assert s.pending == b""


def test_tracker_collects_and_strips_token_ids() -> None:
    t = StreamTracker(chat=True, client_wants_token_ids=False)
    out = t.process(chunk("", [], role=True))
    assert "token_ids" not in json.loads(out[6:])["choices"][0]
    t.process(chunk("Hel", [5, 6]))
    t.process(chunk("lo", [7], finish="length"))
    assert t.token_ids == [5, 6, 7] and t.finished and t.ids_complete
    assert t.resume_body({"max_tokens": 3})["resume"] == {"token_ids": [5, 6, 7]}
    assert t.process(b"data: [DONE]") == b"data: [DONE]" and t.done


def test_tracker_without_ids_cannot_resume() -> None:
    t = StreamTracker(chat=False, client_wants_token_ids=False)
    raw = ev({"id": "x", "choices": [{"index": 0, "text": "hi", "finish_reason": None}]})
    assert t.process(raw) == raw  # untouched bytes pass straight through
    assert not t.ids_complete


def test_tracker_splices_the_resumed_stream() -> None:
    t = StreamTracker(chat=True, client_wants_token_ids=False)
    t.process(chunk("", [], role=True))
    t.process(chunk("ab", [1, 2]))
    t.begin_failover()
    assert t.process(chunk("", [], role=True, cid="c2")) is None  # second role chunk dropped
    out = json.loads(t.process(chunk("c", [3], cid="c2"))[6:])
    assert out["id"] == "c1" and out["created"] == 11 and out["choices"][0]["delta"] == {"content": "c"}
    usage = ev(
        {
            "id": "c2",
            "created": 99,
            "choices": [],
            "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11},
        }
    )
    fixed = json.loads(t.process(usage)[6:])
    assert fixed["usage"] == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}
    assert t.token_ids == [1, 2, 3]


def test_a_stream_of_n_choices_is_finished_when_every_choice_is() -> None:
    # A replica that dies after one of two choices finished has not finished the stream: the relay
    # must then send an error event, not a clean end.
    t = StreamTracker(chat=False, client_wants_token_ids=False, num_choices=2)
    for index, finish in ((0, None), (1, None), (0, "stop"), (1, None)):
        t.process(ev({"id": "x", "choices": [{"index": index, "text": "a", "finish_reason": finish}]}))
    assert not t.finished
    t.process(ev({"id": "x", "choices": [{"index": 1, "text": "", "finish_reason": "length"}]}))
    assert t.finished


def test_generate_streams_are_relayed_as_they_are_and_finish_per_choice() -> None:
    """vLLM's ``/inference/v1/generate`` chunks: only ``token_ids``, relayed byte for byte; the
    stream is finished once every choice sent its finish reason, and its ids are its content."""
    t = GenerateTracker(num_choices=2)
    events = [
        ev(
            {
                "request_id": "g",
                "choices": [{"index": 0, "logprobs": None, "finish_reason": None, "token_ids": [5]}],
            }
        ),
        ev(
            {
                "request_id": "g",
                "choices": [{"index": 1, "logprobs": None, "finish_reason": None, "token_ids": [7]}],
            }
        ),
        ev(
            {
                "request_id": "g",
                "choices": [{"index": 0, "logprobs": None, "finish_reason": "stop", "token_ids": [2]}],
            }
        ),
    ]
    assert [t.process(e) for e in events] == events
    assert t.token_ids == [5, 7, 2] and t.content_choices == 3 and not t.finished
    last = ev(
        {
            "request_id": "g",
            "choices": [{"index": 1, "logprobs": None, "finish_reason": "length", "token_ids": [9]}],
        }
    )
    assert t.process(last) == last and t.finished
    usage = ev({"request_id": "g", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}})
    assert t.process(usage) == usage and t.process(b"data: [DONE]") == b"data: [DONE]" and t.done


def test_ids_the_client_asked_for_are_kept_in_chunks_without_text() -> None:
    # While the router also asks this replica for logprobs (router_logprobs), a chunk with nothing
    # left but the router's logprobs is dropped; one with ids the client asked for is not (a token
    # that completes no UTF-8 character yet has no text).
    partial = {"index": 0, "delta": {"content": ""}, "finish_reason": None, "token_ids": [9]}
    partial["logprobs"] = {"content": [{"token": "token_id:9", "logprob": -1.0}]}
    raw = ev({"id": "c1", "created": 1, "choices": [partial]})
    for keep, kept in ((True, [9]), (False, None)):
        t = StreamTracker(chat=True, client_wants_token_ids=keep)
        t.router_logprobs = True
        out = t.process(raw)
        assert (json.loads(out[6:])["choices"][0]["token_ids"] if out is not None else None) == kept
        assert t.token_ids == [9]


def test_after_a_failover_cached_tokens_stay_within_the_prompt() -> None:
    t = StreamTracker(chat=True, client_wants_token_ids=False)
    t.process(chunk("ab", [1, 2]))
    t.begin_failover()
    t.process(chunk("c", [3], cid="c2"))
    details = {"cached_tokens": 12}  # the resuming replica: prompt and resumed tokens were cached
    usage = {
        "prompt_tokens": 10,
        "completion_tokens": 1,
        "total_tokens": 11,
        "prompt_tokens_details": details,
    }
    fixed = json.loads(t.process(ev({"id": "c2", "choices": [], "usage": usage}))[6:])["usage"]
    assert fixed == {
        "prompt_tokens": 10,
        "completion_tokens": 3,
        "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 10},
    }


def test_a_chunk_with_only_the_routers_ids_is_dropped() -> None:
    # The router asks every replica for return_token_ids; a token that completes no character yet
    # then comes as a chunk with nothing else, which the replica would not have sent the client. Its
    # ids still count (a failover resumes after them); the client's own logprobs, ids or continuous
    # usage keep the chunk, as a replica keeps it for them.
    def partial(**fields) -> bytes:
        choice = {"index": 0, "delta": {}, "finish_reason": None, "token_ids": [9], **fields}
        return ev({"id": "c1", "created": 1, "choices": [choice]})

    t = StreamTracker(chat=True, client_wants_token_ids=False)
    assert t.process(partial()) is None and t.token_ids == [9]
    t = StreamTracker(chat=False, client_wants_token_ids=False)
    raw = ev({"id": "c1", "choices": [{"index": 0, "text": "", "finish_reason": None, "token_ids": [4]}]})
    assert t.process(raw) is None and t.token_ids == [4]
    logprobs = {"content": [{"token": "x", "logprob": -1.0}]}
    usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    t = StreamTracker(chat=True, client_wants_token_ids=False)
    out = t.process(partial(delta={"content": ""}, logprobs=logprobs))
    assert out is not None and json.loads(out[6:])["choices"][0]["logprobs"] == logprobs
    with_usage = ev(
        {"id": "c1", "choices": [{"index": 0, "delta": {}, "finish_reason": None}], "usage": usage}
    )
    assert t.process(with_usage) is not None
    t = StreamTracker(chat=True, client_wants_token_ids=True)
    assert json.loads(t.process(partial())[6:])["choices"][0]["token_ids"] == [9]


def test_prompt_fields_reach_a_client_that_asked_once_per_choice() -> None:
    """vLLM's prompt fields: a chat chunk's top-level ``prompt_token_ids`` / ``prompt_text`` and a
    completions choice's ``prompt_token_ids``, the router's own asking stripped, each choice's sent
    once (a resumed replica sends its prompt again, on its first chunk)."""

    def completion(index: int, ids: list[int], prompt: list[int], cid: str = "c1") -> bytes:
        choice = {
            "index": index,
            "text": "t",
            "finish_reason": None,
            "token_ids": ids,
            "prompt_token_ids": prompt,
        }
        return ev({"id": cid, "created": 1, "choices": [choice]})

    def choices(out: bytes | None) -> list[dict]:
        return json.loads(out[6:])["choices"]

    t = StreamTracker(chat=False, client_wants_token_ids=False, num_choices=2)
    assert "prompt_token_ids" not in choices(t.process(completion(0, [5], [1, 2])))[0]
    t = StreamTracker(chat=False, client_wants_token_ids=True, num_choices=2)
    assert choices(t.process(completion(0, [5], [1, 2])))[0]["prompt_token_ids"] == [1, 2]
    assert choices(t.process(completion(1, [6], [3, 4])))[0]["prompt_token_ids"] == [3, 4]
    t.begin_failover()
    assert "prompt_token_ids" not in choices(t.process(completion(1, [7], [3, 4], cid="c2")))[0]

    def role(**top) -> bytes:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        return ev({"id": "c1", "created": 1, "choices": [choice], **top})

    fields = {"prompt_token_ids": [1, 2], "prompt_text": "<s>hi"}
    t = StreamTracker(chat=True, client_wants_token_ids=False)
    assert {k for k in json.loads(t.process(role(**fields))[6:]) if k.startswith("prompt")} == {"prompt_text"}
    t = StreamTracker(chat=True, client_wants_token_ids=True)
    assert json.loads(t.process(role(**fields))[6:]).items() >= fields.items()
    t.begin_failover()
    # A resumed replica's opening chunk that is not a bare role chunk (it has continuous usage and
    # content, say): relayed, without the prompt fields a second time.
    again = role(**fields, usage={"prompt_tokens": 2})
    again = again.replace(b'"content": ""', b'"content": "x"')
    assert not {k for k in json.loads(t.process(again)[6:]) if k.startswith("prompt")}


def test_prompt_ids_the_client_did_not_ask_for_are_cut_without_parsing() -> None:
    """A replica's compact JSON loses its ``prompt_token_ids`` wherever the field stands (first, in
    the middle, last, in a choice) exactly as parsing and deleting it would; other JSON is parsed."""
    shapes = [
        {
            "prompt_token_ids": [1, 2],
            "id": "c1",
            "choices": [{"index": 0, "text": "a", "finish_reason": None}],
        },
        {"id": "c1", "prompt_token_ids": [1], "prompt_text": "p", "choices": [{"index": 0, "text": "a"}]},
        {
            "id": "c1",
            "choices": [{"index": 0, "text": "a", "prompt_token_ids": [3, 4]}],
            "prompt_token_ids": [],
        },
        {"id": "c1", "choices": [{"index": 0, "text": '"prompt_token_ids":[5]'}]},  # a text, kept
    ]
    for obj in shapes:
        want = json.loads(json.dumps(obj))
        want.pop("prompt_token_ids", None)
        for c in want["choices"]:
            c.pop("prompt_token_ids", None)
        for raw in (json.dumps(obj, separators=(",", ":")), json.dumps(obj)):  # compact, and spaced
            t = StreamTracker(chat=False, client_wants_token_ids=False)
            assert json.loads(t.process(b"data: " + raw.encode())[6:]) == want
