"""Background responses (``background: true``) on one replica with the official SDK: polled to the
same answer as in the foreground, cancelled (the engine request aborted), streamed on after the
client left and resumed from a sequence number, and what is refused. Across API server processes:
test_api_servers.py; across replicas through Redis, and shutdown: test_responses_store.py. The
stores' event logs and cancel flags are tested here on both stores."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from openai.types.responses import ResponseQueuedEvent

from server.responses_memory import EVENT_LOG_OVERHEAD, EVENT_OVERHEAD, RECORD_OVERHEAD, MemoryRecords
from server.responses_memory_stores import MemoryResponseStore
from server.responses_redis import RedisResponseStore
from server.responses_store import EVENT_LOG_LIMIT, EVENT_READ_BATCH
from tests.server.conftest import first_events, wait_in_progress

GREEDY = {"max_output_tokens": 16, "temperature": 0}
# Long enough (~2 s on the tiny model) to be cancelled while it runs: prompt + 900 fit in 1024.
LONG = {"input": "x", "max_output_tokens": 900, "temperature": 0, "extra_body": {"ignore_eos": True}}
RUNNING = ("queued", "in_progress")


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return _client(server.url)


def poll(client: openai.OpenAI, response_id: str):
    """The response once it no longer runs."""
    while (r := client.responses.retrieve(response_id)).status in RUNNING:
        time.sleep(0.02)
    return r


def deltas(events) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def test_polled_to_completion_it_equals_the_foreground_answer(client, server) -> None:
    kw = dict(model=server.model_name, input="Hello there", instructions="Be terse.", **GREEDY)
    foreground = client.responses.create(**kw)
    queued = client.responses.create(background=True, **kw)
    assert queued.status == "queued" and queued.background is True and queued.store is True
    assert queued.output == [] and queued.usage is None and queued.id.startswith("resp_")
    done = poll(client, queued.id)
    assert done.status == foreground.status and done.background is True and done.error is None
    assert done.output_text == foreground.output_text
    # Every count but cached_tokens (the foreground request left the prompt in the prefix cache).
    assert (done.usage.input_tokens, done.usage.output_tokens, done.usage.total_tokens) == (
        foreground.usage.input_tokens,
        foreground.usage.output_tokens,
        foreground.usage.total_tokens,
    )
    # Finished: a cancel changes nothing, and it continues a chain like any stored response.
    assert client.responses.cancel(done.id).model_dump() == done.model_dump()
    chained = client.responses.create(
        model=server.model_name, previous_response_id=done.id, input="And?", **GREEDY
    )
    assert chained.previous_response_id == done.id
    assert chained.usage.input_tokens > done.usage.input_tokens + done.usage.output_tokens


def test_cancel_aborts_its_engine_request(client, server, scrape) -> None:
    long = client.responses.create(model=server.model_name, background=True, **LONG)
    wait_in_progress(client, long.id)
    assert scrape(server.url, "ferry:responses_background_running", model_name=server.model_name) == 1
    # Continuing it while it runs is refused (as OpenAI refuses it).
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=server.model_name, previous_response_id=long.id, input="y")
    assert e.value.body["code"] == "previous_response_in_progress"
    assert e.value.body["param"] == "previous_response_id"
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and cancelled.error is None
    assert 0 < cancelled.usage.output_tokens < 900 and cancelled.output_text  # what it had
    # The abort freed the engine at once: nothing runs, and the gauge is back.
    assert scrape(server.url, "vllm:num_requests_running", model_name=server.model_name) == 0
    assert scrape(server.url, "ferry:responses_background_running", model_name=server.model_name) == 0
    finished = scrape(
        server.url, "ferry:responses_background_total", model_name=server.model_name, status="cancelled"
    )
    assert finished is not None and finished >= 1
    # Idempotent, and what a poll reads.
    assert client.responses.cancel(long.id).model_dump() == cancelled.model_dump()
    assert client.responses.retrieve(long.id).model_dump() == cancelled.model_dump()
    # A chain continues from what it had.
    chained = client.responses.create(
        model=server.model_name, previous_response_id=long.id, input="y", **GREEDY
    )
    assert chained.usage.input_tokens > cancelled.usage.output_tokens


def test_a_background_stream_runs_on_without_its_client_and_resumes(client, server) -> None:
    kw = dict(model=server.model_name, input="Tell me more", **GREEDY)
    foreground = client.responses.create(**kw)
    first = first_events(client.responses.create(background=True, stream=True, **kw), 4)  # then it goes
    # OpenAI's opening of a background stream: created and queued (status queued), then in_progress.
    opening = [(e.type, e.sequence_number, e.response.status) for e in first[:3]]
    assert opening == [
        ("response.created", 0, "queued"),
        ("response.queued", 1, "queued"),
        ("response.in_progress", 2, "in_progress"),
    ]
    assert isinstance(first[1], ResponseQueuedEvent) and first[1].response.id == first[0].response.id
    response_id = first[0].response.id
    rest = list(client.responses.retrieve(response_id, stream=True, starting_after=first[-1].sequence_number))
    events = first + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert rest[-1].type == f"response.{foreground.status}"
    assert deltas(events) == foreground.output_text == rest[-1].response.output_text
    assert poll(client, response_id).output_text == foreground.output_text
    # All of it again, from the store now that it has finished, and from after the queued event.
    again = list(client.responses.retrieve(response_id, stream=True))
    assert [e.model_dump() for e in again] == [e.model_dump() for e in events]
    after_created = client.responses.retrieve(response_id, stream=True, starting_after=0)
    assert [e.model_dump() for e in after_created] == [e.model_dump() for e in events[1:]]
    # A client that has every event gets an empty stream.
    assert list(client.responses.retrieve(response_id, stream=True, starting_after=len(events) - 1)) == []


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "background": True, "store": False}, "background"),
        ({"input": "x", "background": "yes"}, "background"),
        ({"input": [], "background": True}, "input"),
    ],
)
def test_bad_background_requests_are_400s_that_cost_nothing(server, scrape, body, param) -> None:
    for stream in (False, True):
        r = httpx.post(server.url + "/v1/responses", json={**body, "stream": stream}, timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
    assert scrape(server.url, "ferry:responses_background_running", model_name=server.model_name) == 0
    assert scrape(server.url, "vllm:num_requests_running", model_name=server.model_name) == 0


def test_what_cannot_be_cancelled_or_streamed_again(client, server) -> None:
    foreground = client.responses.create(model=server.model_name, input="x", max_output_tokens=1)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.cancel(foreground.id)
    assert e.value.body["code"] == "not_background"
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_unknown")
    background = client.responses.create(
        model=server.model_name, input="x", max_output_tokens=1, background=True
    )
    for response_id in (foreground.id, background.id):  # neither was streamed
        r = httpx.get(f"{server.url}/v1/responses/{response_id}?stream=true", timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
    r = httpx.get(f"{server.url}/v1/responses/{background.id}?stream=true&starting_after=-1", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "starting_after"
    # A second background response under the id of one still running: 409, the first runs on.
    headers = {"X-Request-Id": f"bg-{time.monotonic_ns()}"}
    body = {"input": "x", "max_output_tokens": 900, "ignore_eos": True, "background": True}
    first = httpx.post(server.url + "/v1/responses", json=body, headers=headers, timeout=30)
    again = httpx.post(server.url + "/v1/responses", json=body, headers=headers, timeout=30)
    assert first.status_code == 200 and again.status_code == 409, again.text
    assert again.json()["error"]["code"] == "response_in_progress"
    # Deleting a running one cancels it first (it would otherwise store itself again).
    client.responses.delete(first.json()["id"])
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.json()["id"])
    assert poll(client, background.id).status == "incomplete"  # one token


# -- the stores' event logs and cancel flags --------------------------------------------------------


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_a_store_keeps_the_latest_events_and_cancel_flags(kind, redis_url) -> None:
    store = MemoryResponseStore(10**8, 60.0) if kind == "memory" else RedisResponseStore(redis_url, 60.0)
    try:
        await _check_events_and_flags(store)
    finally:
        await store.close()


async def _check_events_and_flags(store) -> None:
    frames = [f"event: e\ndata: {i}\n\n".encode() for i in range(EVENT_LOG_LIMIT + 10)]
    await store.append_events("r", 0, frames[:3])  # no record: nothing kept (memory) / nothing read
    await store.delete("r")
    assert await store.read_events("r", -1) == (None, [])
    await store.put("r", {"response": {"id": "r"}})
    await store.append_events("r", 0, frames[:10])
    assert await store.read_events("r", 7) == (0, frames[8:10])
    await store.append_events("r", 10, frames[10:])
    first, held = await store.read_events("r", -1)  # the oldest 10 dropped: the latest are held
    assert first == 10 and held == frames[10 : 10 + EVENT_READ_BATCH]
    assert await store.read_events("r", len(frames) - 3) == (10, frames[-2:])
    assert await store.read_events("r", len(frames) - 1) == (10, [])
    await store.request_cancel("r")
    assert await store.cancel_requested(["r", "other"]) == ["r"]
    await store.put("r", {"response": {"id": "r", "status": "cancelled"}})  # the record replaced only
    assert await store.cancel_requested(["r"]) == ["r"] and (await store.read_events("r", -1))[0] == 10
    await store.claim("r", 60.0)  # a new run under this id: the earlier one's flag goes
    assert await store.cancel_requested(["r"]) == []
    await store.request_cancel("r")
    assert await store.delete("r")  # all of it
    assert await store.read_events("r", -1) == (None, []) and await store.cancel_requested(["r"]) == []
    assert not await store.delete("r")


def test_memory_records_count_events_in_their_bytes() -> None:
    r = RECORD_OVERHEAD + 1  # what a record of a one-letter id counts beyond its JSON
    events = EVENT_LOG_OVERHEAD + 10 + 2 * EVENT_OVERHEAD
    records = MemoryRecords(max_bytes=2 * r + 20 + events, ttl_s=10.0)
    assert records.put("a", b"0123456789")
    records.append_events("a", 0, [b"01234", b"56789"])
    assert records.bytes == r + 10 + events
    records.request_cancel("nothing")  # no record: no flag
    assert records.cancel_requested(["nothing"]) == []
    assert records.put("b", b"0123456789")  # at the bound
    assert records.put("c", b"01")  # over it: the least recently used (a) goes, with its events
    assert records.get("a") is None and records.read_events("a", -1) == (None, [])
    assert records.bytes == 2 * r + 12 and len(records) == 2
