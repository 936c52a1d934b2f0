"""Input items that name a stored item (``{"type": "item_reference", "id": …}``, OpenAI's
``ItemReference``; ``type`` may be left out): the request runs, and is stored, as if it had sent the
item itself, on every response store (this process's memory, the engine process's memory behind two
API servers, a Redis that another replica wrote to). An id no stored response holds is OpenAI's 404
(``param`` ``input``), a deleted response's items too; ``--responses-store none`` is a 400."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from server.responses_memory import MemoryRecords
from server.responses_store import encode
from tests.conftest import RedisServer

GREEDY = {"max_output_tokens": 8, "temperature": 0}


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def store_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    srv = RedisServer(tmp_path_factory.mktemp("item-ref-redis"))
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module", params=["memory", "engine-process memory", "redis"])
def replicas(request, tiny_llama: Path, serve_logs: Path, server_process) -> Iterator[tuple]:
    """(the replica that writes the first response, the one that reads it back)."""
    flags = ["--num-kv-blocks", "256"]
    if request.param == "engine-process memory":
        flags += ["--api-server-count", "2"]
    if request.param == "redis":
        flags += ["--responses-store", request.getfixturevalue("store_redis").url]
    count = 2 if request.param == "redis" else 1
    started = [server_process(tiny_llama, flags, serve_logs).start() for _ in range(count)]
    yield started[0], started[-1]
    for srv in started:
        srv.stop()


def test_an_item_reference_is_the_stored_item(replicas) -> None:
    writer, reader = replicas
    model = writer.model_name
    first = _client(writer.url).responses.create(model=model, input="My name is Ada.", **GREEDY)
    client = _client(reader.url)
    asked = client.responses.input_items.list(first.id).data[0]  # the request's user message
    answered = first.output[0]
    question = {"role": "user", "content": "What is my name?"}
    second = client.responses.create(
        model=model,
        input=[{"type": "item_reference", "id": asked.id}, {"id": answered.id}, question],  # type: ignore[list-item]
        **GREEDY,
    )
    # The same answer as the conversation sent whole.
    whole = client.responses.create(
        model=model,
        input=[
            {"role": "user", "content": "My name is Ada."},
            {"role": "assistant", "content": first.output_text},
            question,
        ],
        store=False,
        **GREEDY,
    )
    assert second.output_text == whole.output_text
    assert second.usage.input_tokens == whole.usage.input_tokens
    # Stored with the items themselves (ids included), then the new message.
    items = client.responses.input_items.list(second.id, order="asc").data
    assert [item.model_dump() for item in items[:2]] == [asked.model_dump(), answered.model_dump()]
    assert [(i.type, i.role, i.content[0].text) for i in items[2:]] == [
        ("message", "user", "What is my name?")
    ]
    # A chain continued from it reads those items back too, and so does another reference.
    third = client.responses.create(
        model=model, input=[{"type": "item_reference", "id": second.output[0].id}], **GREEDY
    )
    assert client.responses.input_items.list(third.id).data[0].id == second.output[0].id


def test_an_unknown_or_deleted_item_is_a_404(replicas) -> None:
    writer, reader = replicas
    client = _client(reader.url)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(
            model=reader.model_name, input=[{"type": "item_reference", "id": "msg_nope"}], **GREEDY
        )
    assert err.value.body == {
        "message": "Item with id 'msg_nope' not found.",
        "type": "NotFoundError",
        "param": "input",
        "code": None,
    }
    first = _client(writer.url).responses.create(model=writer.model_name, input="Hi", **GREEDY)
    _client(writer.url).responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(
            model=reader.model_name, input=[{"type": "item_reference", "id": first.output[0].id}], **GREEDY
        )
    assert err.value.body["message"] == f"Item with id '{first.output[0].id}' not found."
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=reader.model_name, input=[{"type": "item_reference"}], **GREEDY)  # type: ignore[list-item]
    assert err.value.body["param"] == "input"
    assert err.value.body["message"] == "input[0]: an item_reference needs the id of a stored item"


def test_store_none_refuses_item_references(tiny_llama: Path, serve_logs: Path, server_process) -> None:
    srv = server_process(tiny_llama, ["--responses-store", "none", "--num-kv-blocks", "128"], serve_logs)
    srv.start()
    try:
        with pytest.raises(openai.BadRequestError) as err:
            _client(srv.url).responses.create(
                model=srv.model_name, input=[{"type": "item_reference", "id": "msg_1"}], **GREEDY
            )
        assert err.value.body["param"] == "input" and "--responses-store none" in err.value.message
    finally:
        srv.stop()


def _record(output_id: str, *input_ids: str) -> dict:
    return {
        "input": [{"type": "message", "id": i, "role": "user", "content": []} for i in input_ids],
        "response": {"status": "completed", "output": [{"type": "message", "id": output_id}]},
    }


def test_memory_records_index_items_to_the_latest_record_holding_them() -> None:
    now = [0.0]
    records = MemoryRecords(max_bytes=10**6, ttl_s=10.0, clock=lambda: now[0])
    a, b = _record("out_a", "in_1"), _record("out_b", "in_1", "out_a")
    assert records.put("a", encode(a), ["in_1", "out_a"])
    assert records.put("b", encode(b), ["in_1", "out_a", "out_b"])
    assert records.find_item("in_1") == encode(b) and records.find_item("out_b") == encode(b)
    assert records.find_item("nope") is None
    assert records.delete("a")  # its items are b's now: still found
    assert records.find_item("out_a") == encode(b)
    now[0] = 11.0  # b expired
    assert records.find_item("out_b") is None and records.find_item("in_1") is None
    assert len(records) == 0
