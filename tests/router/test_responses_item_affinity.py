"""The Responses API's stored items behind a router, read with the official SDK: an input
``item_reference`` names an item that only the replica which stored it can resolve (memory stores,
one per replica), so the router sends such a request there, as it sends ``previous_response_id``;
and a stream the router cannot resume ends with its open items closed ``incomplete``, as a failing
replica ends one."""

from __future__ import annotations

import openai
import pytest
from router_harness import Cluster, Proc, metric, replicas_view

MODEL = "llama"
SHORT = {"max_output_tokens": 3, "temperature": 0.0}


@pytest.fixture(scope="module")
def replicas(cluster: Cluster) -> list[Proc]:
    return cluster.replicas(2)


@pytest.fixture(scope="module")
def router(cluster: Cluster, replicas: list[Proc]) -> Proc:
    """Round robin: without affinity, a request goes to the other replica after one went to one."""
    args = [a for r in replicas for a in ("--replica", r.url)]
    return cluster.router(*args, "--policy", "round_robin")


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)


def _served(router: Proc) -> dict[str, int]:
    return {url: v["total_requests"] for url, v in replicas_view(router).items()}


def _where(router: Proc, before: dict[str, int]) -> list[str]:
    """The replicas that took requests since ``before``, one entry per request."""
    return [url for url, n in _served(router).items() for _ in range(n - before[url])]


def _ref(item_id: str) -> dict:
    return {"type": "item_reference", "id": item_id}


def _not_found(router: Proc, item_id: str, **request) -> None:
    """The request went to a replica that does not hold ``item_id``: OpenAI's 404 for it."""
    with pytest.raises(openai.NotFoundError) as err:
        _client(router.url).responses.create(model=MODEL, **SHORT, **request)
    assert err.value.body["message"] == f"Item with id '{item_id}' not found."


def test_an_item_of_a_whole_answer_is_read_where_it_is_stored(router: Proc, replicas: list[Proc]) -> None:
    client = _client(router.url)
    before = _served(router)
    mine = {"type": "message", "role": "user", "content": "My name is Ada.", "id": "msg_ada_from_client"}
    first = client.responses.create(model=MODEL, input=[mine], **SHORT)  # type: ignore[list-item]
    (home,) = _where(router, before)
    (other,) = [r.url for r in replicas if r.url != home]
    answered = first.output[0].id
    # Memory stores: the other replica cannot resolve it.
    with pytest.raises(openai.NotFoundError):
        _client(other).responses.create(model=MODEL, input=[_ref(answered)], **SHORT)
    hits = metric(router.url, "ferry:router_response_affinity_total", {"outcome": "hit"})
    before = _served(router)
    question = {"role": "user", "content": "What is my name?"}
    # The output item, the client's own input item (kept under the id it sent), a bare reference.
    for refs in ([_ref(answered)], [_ref("msg_ada_from_client")], [{"id": answered}]):
        follow = client.responses.create(model=MODEL, input=[*refs, question], **SHORT)  # type: ignore[list-item]
        assert follow.status in ("completed", "incomplete")
    assert _where(router, before) == [home] * 3
    assert metric(router.url, "ferry:router_response_affinity_total", {"outcome": "hit"}) == hits + 3


def test_an_item_of_a_streamed_answer_is_read_where_it_is_stored(router: Proc) -> None:
    client = _client(router.url)
    before = _served(router)
    with client.responses.stream(model=MODEL, input="Tell me a story.", **SHORT) as stream:
        *_, last = stream  # cut at max_output_tokens: the SDK gives no final response, the event does
    assert last.type == "response.incomplete"
    final = last.response
    (home,) = _where(router, before)
    before = _served(router)
    for _ in range(2):  # round robin alone would send one of the two elsewhere
        follow = client.responses.create(model=MODEL, input=[_ref(final.output[0].id)], **SHORT)
        assert follow.status in ("completed", "incomplete")
    assert _where(router, before) == [home] * 2


def test_an_item_of_a_background_stream_is_read_where_it_is_stored(router: Proc) -> None:
    """A background stream is relayed as it is: the router reads only its stored end."""
    client = _client(router.url)
    before = _served(router)
    *_, last = client.responses.create(
        model=MODEL, input="Tell me a story.", background=True, stream=True, **SHORT
    )
    assert last.type == "response.incomplete"
    (home,) = _where(router, before)
    before = _served(router)
    for _ in range(2):
        follow = client.responses.create(model=MODEL, input=[_ref(last.response.output[0].id)], **SHORT)
        assert follow.status in ("completed", "incomplete")
    assert _where(router, before) == [home] * 2


def test_an_input_item_id_read_back_from_the_store_is_read_where_it_is_stored(router: Proc) -> None:
    """An input item sent without an id gets one from its replica; the client learns it from the
    stored response's ``input_items`` (read through the router) and may name it."""
    client = _client(router.url)
    before = _served(router)
    first = client.responses.create(model=MODEL, input="My name is Ada.", **SHORT)
    (home,) = _where(router, before)
    (asked,) = client.responses.input_items.list(first.id).data
    assert asked.id.startswith("msg_")
    before = _served(router)
    for _ in range(2):
        follow = client.responses.create(model=MODEL, input=[_ref(asked.id)], **SHORT)
        assert follow.status in ("completed", "incomplete")
    assert _where(router, before) == [home] * 2


def test_references_to_items_on_two_replicas_go_where_most_of_them_are(router: Proc) -> None:
    """No replica holds them all (memory stores): one reference is a 404 wherever the request goes.
    The router sends it where ``previous_response_id`` is, else where most references are, else
    where the first one is; the 404 says which item that replica lacks."""
    client = _client(router.url)
    stored: dict[str, list] = {}
    for text in ("One.", "Two.", "Three.", "Four."):
        before = _served(router)
        response = client.responses.create(model=MODEL, input=text, **SHORT)
        (home,) = _where(router, before)
        stored.setdefault(home, []).append(response)
    (a1, a2), (b1, b2) = stored.values()  # round robin: two on each
    _not_found(
        router, a1.output[0].id, input=[_ref(a1.output[0].id), _ref(b1.output[0].id), _ref(b2.output[0].id)]
    )
    _not_found(router, b1.output[0].id, input=[_ref(a1.output[0].id), _ref(b1.output[0].id)])
    _not_found(router, b1.output[0].id, input=[_ref(b1.output[0].id), _ref(a1.output[0].id)][::-1])
    _not_found(
        router,
        a1.output[0].id,
        previous_response_id=b1.id,
        input=[_ref(a1.output[0].id), _ref(a2.output[0].id)],
    )


@pytest.fixture(scope="module")
def victim(cluster: Cluster) -> Proc:
    (started,) = cluster.replicas(1)
    return started


def test_a_stream_the_router_cannot_resume_ends_with_its_item_incomplete(
    cluster: Cluster, victim: Proc
) -> None:
    """The replica is killed mid-answer and the router may not resume (``--max-failovers 0``): the
    client's open message is closed ``incomplete`` with the text it has, then the error and
    ``response.failed``, whose output says the same."""
    router = cluster.router("--replica", victim.url, "--max-failovers", "0")
    events: list = []
    request = {"max_output_tokens": 800, "temperature": 0.0, "extra_body": {"ignore_eos": True}}
    with pytest.raises(RuntimeError, match="response.completed"):
        with _client(router.url).responses.stream(
            model=MODEL, input="Write a long story.", **request
        ) as stream:
            for event in stream:
                events.append(event)
                if len(events) == 6:
                    assert replicas_view(router)[victim.url]["inflight"] == 1
                    victim.kill9()
            stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[-5:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "error",
        "response.failed",
    ]
    assert "cannot be resumed" in events[-2].message
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    added = next(e.item for e in events if e.type == "response.output_item.added")
    done = events[-3].item
    assert done.id == added.id and done.status == "incomplete" and done.content[0].text == text
    assert events[-5].text == events[-4].part.text == text
    (item,) = events[-1].response.output
    assert events[-1].response.status == "failed"
    assert item.id == added.id and item.status == "incomplete" and item.content[0].text == text


def test_which_items_a_request_names_and_a_response_stored() -> None:
    from router.response_affinity import (
        ResponseAffinity,
        listed_item_ids,
        referenced_items,
        stored_item_ids,
    )

    body = {
        "input": [
            {"type": "item_reference", "id": "msg_1"},
            {"id": "fc_2"},  # no type, no role: a reference (the replica's rule)
            {"type": None, "id": "rs_3"},
            {"role": "user", "content": "x", "id": "msg_4"},  # an item of its own, with an id
            {"type": "item_reference"},  # no id: the replica's 400
            "not an item",
        ]
    }
    assert referenced_items(body) == ["msg_1", "fc_2", "rs_3"]
    assert referenced_items({"input": "text"}) == [] and referenced_items(None) == []
    answer = {"object": "response", "store": True, "output": [{"id": "msg_5"}, {"type": "x"}]}
    assert stored_item_ids(body, answer) == ["msg_1", "fc_2", "rs_3", "msg_4", "msg_5"]
    assert stored_item_ids(body, {**answer, "store": False}) == []
    assert listed_item_ids(answer) == ["msg_5"] and listed_item_ids({**answer, "store": False}) == []
    assert listed_item_ids({"object": "list", "data": [{"id": "msg_6"}, {"id": "msg_7"}]}) == [
        "msg_6",
        "msg_7",
    ]

    affinity = ResponseAffinity(max_entries=3)
    affinity.remember_items(["a1", "a2"], "http://a")
    affinity.remember_items(["b1"], "http://b")
    assert affinity.lookup_items(["a1", "b1", "nope"]) == "http://a"  # equals: the first named
    assert affinity.lookup_items(["b1", "a1"]) == "http://b"
    assert affinity.lookup_items(["b1", "a1", "a2"]) == "http://a"  # most of them
    assert affinity.lookup_items(["nope"]) is None
    affinity.remember_items(["b2"], "http://b")  # b1 is the least recently used: it goes
    assert affinity.items == 3 and affinity.lookup_items(["b1"]) is None
    assert affinity.lookup_items(["a1", "a2", "b2"]) == "http://a" and len(affinity) == 0  # responses apart
