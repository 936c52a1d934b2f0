"""Stored responses (``--responses-store``): ``previous_response_id`` chains, ``GET`` / ``DELETE
/v1/responses/{id}`` and ``input_items`` with the official SDK; a chain continued on another
replica through a shared Redis (background responses too: read, resumed and cancelled on another
replica; saved as failed by a replica shutting down, and reported failed once a killed one's lease
lapsed); Redis down; ``none``; and the memory store's bounds."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import redis

from server.responses_input import input_items
from server.responses_memory import RECORD_OVERHEAD, MemoryRecords
from server.responses_records import item_page
from server.responses_store import encode
from tests.conftest import RedisServer
from tests.server.conftest import first_events, wait_in_progress

GREEDY = {"max_output_tokens": 8, "temperature": 0}
# A background response long enough (~2 s on the tiny model) to be caught running.
LONG_BACKGROUND = {"input": "x", "max_output_tokens": 900, "temperature": 0}
RUNNING = ("queued", "in_progress")


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return _client(server.url)


def test_a_chain_continues_the_stored_conversation(client, server) -> None:
    first = client.responses.create(
        model=server.model_name, input="My name is Ada.", instructions="Be terse.", **GREEDY
    )
    assert first.store is True and first.previous_response_id is None
    second = client.responses.create(
        model=server.model_name, previous_response_id=first.id, input="What is my name?", **GREEDY
    )
    assert second.previous_response_id == first.id
    # The same as the whole conversation sent to chat (earlier instructions not carried over).
    chat = client.chat.completions.create(
        model=server.model_name,
        messages=[
            {"role": "user", "content": "My name is Ada."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "What is my name?"},
        ],
        max_tokens=8,
        temperature=0,
    )
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    # A streamed third turn, stored before its last event: retrievable at once.
    events = list(
        client.responses.create(
            model=server.model_name, previous_response_id=second.id, input="And again?", stream=True, **GREEDY
        )
    )
    assert events[-1].type in ("response.completed", "response.incomplete")
    third = events[-1].response
    assert third.previous_response_id == second.id and third.store is True
    again = client.responses.retrieve(third.id)
    assert again.id == third.id and again.output_text == third.output_text
    assert again.usage.input_tokens == third.usage.input_tokens > second.usage.input_tokens


def test_retrieve_delete_and_input_items(client, server) -> None:
    first = client.responses.create(model=server.model_name, input="One", **GREEDY)
    second = client.responses.create(
        model=server.model_name,
        previous_response_id=first.id,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Two"}]}],
        **GREEDY,
    )
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text and got.created_at == first.created_at
    # Input items: the whole conversation before the answer, newest first by default.
    items = client.responses.input_items.list(second.id)
    texts = [(i.type, i.role, i.content[0].text) for i in items.data]
    assert texts == [
        ("message", "user", "Two"),
        ("message", "assistant", first.output_text),
        ("message", "user", "One"),
    ]
    assert items.data[1].id == first.output[0].id  # the earlier output item, as it was answered
    asc = client.responses.input_items.list(second.id, order="asc")
    assert [i.id for i in asc.data] == [i.id for i in items.data][::-1]
    page = client.responses.input_items.list(second.id, limit=2)
    assert [i.id for i in page.data] == [i.id for i in items.data][:2] and page.has_more
    rest = client.responses.input_items.list(second.id, limit=2, after=page.data[-1].id)
    assert [i.id for i in rest.data] == [items.data[2].id] and not rest.has_more
    # Deleted: gone for retrieve and for chains; what was built on it keeps its own record.
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=server.model_name, previous_response_id=first.id, input="x", **GREEDY)
    assert e.value.body["code"] == "previous_response_not_found"
    assert e.value.body["param"] == "previous_response_id"
    third = client.responses.create(
        model=server.model_name, previous_response_id=second.id, input="3", **GREEDY
    )
    assert third.status in ("completed", "incomplete")
    r = httpx.delete(f"{server.url}/v1/responses/{first.id}", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"


def test_a_reused_request_id_never_replaces_another_stored_response(client, server) -> None:
    # The id follows X-Request-Id (the router's affinity relies on it): a second, different request
    # under it is a 409 and the first stays as it was; the same input again is a retry, answered.
    request_id = f"mine-{time.monotonic_ns()}"
    headers = {"X-Request-Id": request_id}
    first = client.responses.create(
        model=server.model_name, input="My name is Ada.", extra_headers=headers, **GREEDY
    )
    assert first.id == f"resp_{request_id}"
    with pytest.raises(openai.ConflictError) as e:
        client.responses.create(
            model=server.model_name, input="My name is Bo.", extra_headers=headers, **GREEDY
        )
    assert e.value.code == "response_id_in_use"
    kept = client.responses.retrieve(first.id)
    assert kept.output_text == first.output_text
    assert [i.content[0].text for i in client.responses.input_items.list(first.id).data] == [
        "My name is Ada."
    ]
    again = client.responses.create(
        model=server.model_name, input="My name is Ada.", extra_headers=headers, **GREEDY
    )
    assert again.id == first.id and again.output_text == first.output_text


def test_vllms_request_id_field_is_the_response_id(client, server) -> None:
    # vLLM's body field names the response as given (X-Request-Id or not), whole or streamed; it
    # is read, continued and deleted under that name, and a reuse is the X-Request-Id's 409.
    named = f"mine-{time.monotonic_ns()}"
    kw = dict(model=server.model_name, **GREEDY)
    headers = {"X-Request-Id": f"other-{named}"}
    first = client.responses.create(input="Hi", extra_headers=headers, extra_body={"request_id": named}, **kw)
    assert first.id == named and client.responses.retrieve(named).output_text == first.output_text
    streamed = list(
        client.responses.create(
            input="And?",
            previous_response_id=named,
            stream=True,
            extra_body={"request_id": named + ".2"},
            **kw,
        )
    )
    assert {e.response.id for e in streamed if hasattr(e, "response")} == {named + ".2"}
    assert client.responses.retrieve(named + ".2").previous_response_id == named
    with pytest.raises(openai.ConflictError) as e:
        client.responses.create(input="Bye", extra_body={"request_id": named}, **kw)
    assert e.value.code == "response_id_in_use"
    client.responses.delete(named)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(named)
    for bad in ("a/b", "", "x" * 129, 7):  # a path's /v1/responses/{id} must name it
        r = httpx.post(f"{server.url}/v1/responses", json={"input": "x", "request_id": bad}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "request_id", r.text


def test_a_request_id_with_a_slash_names_a_response_that_can_be_read(client, server) -> None:
    # "/" is fine in X-Request-Id, not in /v1/responses/{id}: such ids are digested.
    headers = {"X-Request-Id": f"team/a=1/{time.monotonic_ns()}"}
    r = client.responses.create(model=server.model_name, input="Hello", extra_headers=headers, **GREEDY)
    assert r.id.startswith("resp_") and "/" not in r.id and len(r.id) == len("resp_") + 32
    assert client.responses.retrieve(r.id).output_text == r.output_text
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_the_memory_stores_size_is_in_metrics(client, server, scrape) -> None:
    def size() -> tuple[float, float]:
        return scrape(server.url, "ferry:responses_stored") or 0.0, scrape(
            server.url, "ferry:responses_stored_bytes"
        ) or 0.0

    records, nbytes = size()
    first = client.responses.create(model=server.model_name, input="One", **GREEDY)
    client.responses.create(model=server.model_name, previous_response_id=first.id, input="Two", **GREEDY)
    grown = size()
    assert grown[0] == records + 2 and grown[1] > nbytes
    client.responses.delete(first.id)
    shrunk = size()
    assert shrunk[0] == records + 1 and nbytes < shrunk[1] < grown[1]


def test_store_false_keeps_nothing(client, server) -> None:
    r = client.responses.create(model=server.model_name, input="Hi", store=False, **GREEDY)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=server.model_name, previous_response_id=r.id, input="x", **GREEDY)


@pytest.mark.parametrize(
    ("path", "query"),
    [("/v1/responses/resp_x/input_items", "limit=0"), ("/v1/responses/resp_x/input_items", "order=up")],
)
def test_bad_list_parameters_are_a_400(server, path, query) -> None:
    r = httpx.get(f"{server.url}{path}?{query}", timeout=30)
    assert r.status_code == 400, r.text


# -- other stores ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def store_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """This module's own redis-server (a test stops and restarts it)."""
    srv = RedisServer(tmp_path_factory.mktemp("responses-redis"))
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def shared_pair(tiny_llama: Path, serve_logs: Path, server_process, store_redis) -> Iterator[list]:
    """Two replicas keeping their responses in one Redis."""
    flags = ["--responses-store", store_redis.url, "--num-kv-blocks", "256"]
    replicas = [server_process(tiny_llama, flags, serve_logs).start() for _ in range(2)]
    yield replicas
    for srv in replicas:
        srv.stop()


def test_a_chain_continues_on_another_replica_through_redis(shared_pair, store_redis, scrape) -> None:
    a, b = shared_pair
    first = _client(a.url).responses.create(model=a.model_name, input="My name is Ada.", **GREEDY)
    second = _client(b.url).responses.create(
        model=b.model_name, previous_response_id=first.id, input="What is my name?", **GREEDY
    )
    local = _client(a.url).responses.create(
        model=a.model_name,
        input=[
            {"role": "user", "content": "My name is Ada."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "What is my name?"},
        ],
        **GREEDY,
    )
    assert second.output_text == local.output_text and second.usage.input_tokens == local.usage.input_tokens
    assert _client(b.url).responses.retrieve(first.id).output_text == first.output_text
    import redis

    ttl = redis.Redis.from_url(store_redis.url).pttl(f"ferry:response:{first.id}")
    assert 29 * 24 * 3600 * 1000 < ttl <= 30 * 24 * 3600 * 1000
    _client(b.url).responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        _client(a.url).responses.retrieve(first.id)


def test_redis_down_is_a_503_for_chains_and_answers_still_come(shared_pair, store_redis, scrape) -> None:
    a, _ = shared_pair
    first = _client(a.url).responses.create(model=a.model_name, input="Hi", **GREEDY)
    store_redis.stop()
    try:
        with pytest.raises(openai.InternalServerError) as e:  # 503
            _client(a.url).responses.create(
                model=a.model_name, previous_response_id=first.id, input="x", **GREEDY
            )
        assert e.value.status_code == 503
        r = _client(a.url).responses.create(model=a.model_name, input="Hi", **GREEDY)
        assert r.store is False and r.output  # answered, and says it was not stored
        assert scrape(a.url, "ferry:responses_not_stored_total", model_name=a.model_name) == 1.0
        assert httpx.get(a.url + "/health", timeout=10).status_code == 200
    finally:
        store_redis.start()  # empty again (it keeps nothing on disk): the replica uses it at once
    first = _client(a.url).responses.create(model=a.model_name, input="Hi", **GREEDY)
    assert first.store is True
    chained = _client(a.url).responses.create(
        model=a.model_name, previous_response_id=first.id, input="x", **GREEDY
    )
    assert chained.previous_response_id == first.id


def test_a_background_response_on_one_replica_is_streamed_and_cancelled_on_another(
    shared_pair, store_redis, scrape
) -> None:
    """Through the shared Redis: the record, the events (resumed on B) and the cancel flag (asked
    on B, read by A, which aborts its engine request)."""
    a, b = shared_pair
    kw = dict(model=a.model_name, input="Tell me more", max_output_tokens=16, temperature=0)
    foreground = _client(a.url).responses.create(**kw)
    first = first_events(_client(a.url).responses.create(background=True, stream=True, **kw), 3)
    response_id = first[0].response.id
    rest = list(_client(b.url).responses.retrieve(response_id, stream=True, starting_after=2))
    events = first + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == foreground.output_text == rest[-1].response.output_text
    import redis

    ttl = redis.Redis.from_url(store_redis.url).pttl(f"ferry:response-events:{response_id}")
    assert 29 * 24 * 3600 * 1000 < ttl <= 30 * 24 * 3600 * 1000  # the record's
    long = _client(a.url).responses.create(
        model=a.model_name, background=True, **LONG_BACKGROUND, extra_body={"ignore_eos": True}
    )
    wait_in_progress(_client(b.url), long.id)
    cancelled = _client(b.url).responses.cancel(long.id)
    assert cancelled.status == "cancelled" and 0 < cancelled.usage.output_tokens < 900
    assert _client(a.url).responses.retrieve(long.id).model_dump() == cancelled.model_dump()
    assert scrape(a.url, "vllm:num_requests_running", model_name=a.model_name) == 0
    assert scrape(a.url, "ferry:responses_background_running", model_name=a.model_name) == 0


def test_shutdown_saves_a_running_background_response_as_failed(
    tiny_llama: Path, serve_logs: Path, server_process, shared_pair, store_redis
) -> None:
    flags = ["--responses-store", store_redis.url, "--num-kv-blocks", "128", "--drain-timeout", "0.1"]
    srv = server_process(tiny_llama, flags, serve_logs).start()
    a, _ = shared_pair
    try:
        long = _client(srv.url).responses.create(
            model=srv.model_name, background=True, **LONG_BACKGROUND, extra_body={"ignore_eos": True}
        )
        wait_in_progress(_client(a.url), long.id)
        # A clean exit (not killed at stop's bound) that failed it with "shut down" (below): the
        # drain ended the background response, however long a loaded machine takes to exit.
        assert srv.stop() == 0
    finally:
        srv.stop()
    failed = _client(a.url).responses.retrieve(long.id)
    assert failed.status == "failed" and failed.error.code == "server_error"
    assert "shut down" in failed.error.message and 0 < failed.usage.output_tokens < 900


def test_a_killed_replicas_background_response_fails_once_its_lease_lapses(
    tiny_llama: Path, serve_logs: Path, server_process, shared_pair, store_redis, scrape
) -> None:
    """A replica renews the leases of its background responses (a 1 s TTL here) while they wait and
    run: polled from another replica all along, none is failed. SIGKILLed while running a streamed
    one: the replicas sharing its Redis report that one failed within the TTL (once), and a stream
    following it there ends with response.failed."""
    ttl = 1.0
    flags = ["--responses-store", store_redis.url, "--num-kv-blocks", "128", "--max-num-seqs", "1"]
    srv = server_process(tiny_llama, [*flags, "--responses-lease-ttl", str(ttl)], serve_logs).start()
    a, b = shared_pair
    store = redis.Redis.from_url(store_redis.url)
    body = dict(model=srv.model_name, background=True, **LONG_BACKGROUND, extra_body={"ignore_eos": True})
    try:
        # One at a time: the last waits queued for the other two, then runs, renewed every 0.2 s
        # (its lease's TTL seen going up again) however fast this machine runs them.
        ids = [_client(srv.url).responses.create(**{**body, "max_output_tokens": 600}).id for _ in range(3)]
        renewed, last_pttl, polled = 0, ttl * 1000, {}
        while any(polled.get(i, "queued") in RUNNING for i in ids):
            for i in ids:
                polled[i] = _client(a.url).responses.retrieve(i).status
                assert polled[i] != "failed", i
            pttl = store.pttl(f"ferry:response-lease:{ids[-1]}")
            assert pttl > 0 or polled[ids[-1]] == "incomplete", pttl
            renewed += pttl > last_pttl
            last_pttl = pttl
            time.sleep(0.02)
        assert all(_client(a.url).responses.retrieve(i).usage.output_tokens == 600 for i in ids)
        # Seen going up once at least (a poll can take longer than the renewal period under load,
        # and then sees a fresh TTL each time); the lease held past its 1 s TTL all along is
        # checked by the pttl assertion in the loop.
        assert set(polled.values()) == {"incomplete"} and renewed >= 1, (polled, renewed)
        first = first_events(_client(srv.url).responses.create(stream=True, **body), 4)  # it runs
        response_id = first[0].response.id
        while store.xlen(f"ferry:response-events:{response_id}") < 4:  # its first batch is kept
            time.sleep(0.005)
        srv.proc.kill()
        killed = time.monotonic()
        with ThreadPoolExecutor(1) as pool:
            follower = pool.submit(lambda: list(_client(b.url).responses.retrieve(response_id, stream=True)))
            while (failed := _client(a.url).responses.retrieve(response_id)).status in RUNNING:
                assert time.monotonic() - killed < 60, "never reported failed"
                time.sleep(0.05)
            took = time.monotonic() - killed
            events = follower.result(timeout=60)
    finally:
        srv.stop()
    assert failed.status == "failed" and failed.error.code == "server_error", failed
    assert "the process running it stopped" in failed.error.message
    # No sooner than its lease lapsed (nothing else can tell: its process is gone); the upper bound
    # only tells the lapse from a hang, as a loaded machine's polls are slow.
    assert 0.5 < took < ttl + 30, f"reported failed {took:.1f} s after the kill"
    assert events[0].type == "response.created" and events[-1].type == "response.failed"
    assert events[-1].response.model_dump() == failed.model_dump()
    assert [e.sequence_number for e in events] == list(range(len(events))) and len(events) >= 5
    assert _client(b.url).responses.retrieve(response_id).model_dump() == failed.model_dump()
    orphaned = [
        scrape(r.url, "ferry:responses_background_orphaned_total", model_name=r.model_name) for r in (a, b)
    ]
    assert sorted(orphaned) == [0, 1]


def test_store_none(tiny_llama: Path, serve_logs: Path, server_process) -> None:
    srv = server_process(
        tiny_llama, ["--responses-store", "none", "--num-kv-blocks", "128"], serve_logs
    ).start()
    try:
        r = _client(srv.url).responses.create(model=srv.model_name, input="Hi", **GREEDY)
        assert r.store is False
        with pytest.raises(openai.NotFoundError):
            _client(srv.url).responses.retrieve(r.id)
        with pytest.raises(openai.BadRequestError) as e:
            _client(srv.url).responses.create(
                model=srv.model_name, previous_response_id=r.id, input="x", **GREEDY
            )
        assert e.value.body["param"] == "previous_response_id" and "--responses-store none" in e.value.message
        with pytest.raises(openai.BadRequestError) as e:
            _client(srv.url).responses.create(model=srv.model_name, input="x", background=True, **GREEDY)
        assert e.value.body["param"] == "background" and "--responses-store none" in e.value.message
    finally:
        srv.stop()


# -- the parts ---------------------------------------------------------------------------------


def test_memory_records_drop_the_least_recently_used_beyond_their_bytes() -> None:
    now = [0.0]
    r = RECORD_OVERHEAD + 1  # what a record of a one-letter id counts beyond its JSON
    records = MemoryRecords(max_bytes=3 * r + 25, ttl_s=10.0, clock=lambda: now[0])
    assert records.put("a", b"0123456789") and records.put("b", b"0123456789")
    assert records.bytes == 2 * r + 20
    assert records.get("a") == b"0123456789"  # a is now the most recently used
    assert records.put("c", b"01234")
    assert records.bytes == 3 * r + 25 and len(records) == 3
    assert records.put("d", b"0")  # one byte over: the least recently used (b) goes
    assert records.get("b") is None and records.bytes == 3 * r + 16
    assert records.put("a", b"x")  # replaced, not added
    assert records.bytes == 3 * r + 7
    assert not records.put("big", b"x" * (records.max_bytes - RECORD_OVERHEAD - 2))  # one byte over
    assert records.get("big") is None
    now[0] = 10.0  # written at 0 with a 10 s TTL: expired
    assert records.get("a") is None and records.get("c") is None
    assert records.bytes == r + 1 and records.delete("d") and records.bytes == 0
    assert not records.delete("d")


def test_input_items_name_every_item() -> None:
    items = input_items("Hi")
    assert items[0]["role"] == "user" and items[0]["content"] == [{"type": "input_text", "text": "Hi"}]
    assert items[0]["id"].startswith("msg_") and items[0]["type"] == "message"
    items = input_items(
        [
            {"role": "assistant", "content": "Yes"},
            {"type": "function_call_output", "call_id": "c", "output": "1"},
            {"type": "message", "id": "msg_keep", "role": "user", "content": "x"},
            "not an item",
            {"type": []},
        ]
    )
    assert items[0]["content"] == [{"type": "output_text", "text": "Yes", "annotations": []}]
    assert items[1]["id"].startswith("fco_") and items[2]["id"] == "msg_keep" and len(items) == 3
    assert items[1]["status"] == "completed"  # OpenAI lists a call output with its status
    assert len(encode({"input": items})) > 0


def test_item_pages() -> None:
    items = [{"id": f"i{k}"} for k in range(5)]
    page = item_page(items, 2, "asc", None, None)
    assert [i["id"] for i in page["data"]] == ["i0", "i1"] and page["has_more"]
    assert (page["first_id"], page["last_id"]) == ("i0", "i1")
    page = item_page(items, 10, "desc", "i3", None)
    assert [i["id"] for i in page["data"]] == ["i2", "i1", "i0"] and not page["has_more"]
    page = item_page(items, 10, "asc", "i0", "i3")
    assert [i["id"] for i in page["data"]] == ["i1", "i2"] and not page["has_more"]
    assert item_page([], 5, "desc", None, None) == {
        "object": "list",
        "data": [],
        "first_id": None,
        "last_id": None,
        "has_more": False,
    }


@pytest.mark.parametrize(
    "response_id", ["resp_%2Fetc", "r" * 5000, "résumé_☃", "resp_x%00y", "..%2F..%2Fhealth"]
)
def test_odd_ids_are_404s(server, response_id: str) -> None:
    for method, suffix in (("GET", ""), ("DELETE", ""), ("GET", "/input_items")):
        r = httpx.request(method, f"{server.url}/v1/responses/{response_id}{suffix}", timeout=30)
        assert r.status_code == 404, (method, suffix, r.text)
        assert r.json()["error"]["code"] in ("response_not_found", "not_found")  # no such route: %2F is a /
    r = httpx.post(
        server.url + "/v1/responses",
        json={"input": "x", "previous_response_id": response_id, "max_output_tokens": 1},
        timeout=30,
    )
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
