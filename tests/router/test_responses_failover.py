"""The Responses API's streams through the router when their replica is killed (kill -9) part-way,
read with the official SDK's stream helper (which assembles and checks the events): the answer goes
on from another replica exactly, as one response (same id, one item, sequence numbers without gap),
is stored whole where the router will find it, and a stream that cannot be resumed ends with an
error event and ``response.failed``, never with corrupt output."""

from __future__ import annotations

import openai
import pytest
from router_harness import Cluster, Proc, metric, replicas_view, wait_until

MODEL = "llama"
PROMPT = "Write a long story."
# A named tool: the call's arguments stream.
STORY_TOOL = {
    "tools": [
        {
            "type": "function",
            "name": "tell",
            "parameters": {
                "type": "object",
                # Long enough to be cut mid-way, short enough to end (the SDK's helper needs a
                # completed response).
                "properties": {"story": {"type": "string", "minLength": 1500, "maxLength": 1500}},
                "required": ["story"],
            },
        }
    ],
    "tool_choice": {"type": "function", "name": "tell"},
}


@pytest.fixture(scope="module")
def replicas(cluster: Cluster) -> list[Proc]:
    """A survivor and three victims (one per test), loaded together."""
    return cluster.replicas(4)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)


def _killed_mid_stream(router: Proc, victim: Proc, events: list, kill_at: int = 6, **request):
    """The final response the SDK assembled from a stream whose replica is killed after ``kill_at``
    events (collected in ``events``)."""
    with _client(router.url).responses.stream(model=MODEL, input=PROMPT, **request) as stream:
        for event in stream:
            events.append(event)
            if len(events) == kill_at:
                assert replicas_view(router)[victim.url]["inflight"] == 1
                victim.kill9()
        return stream.get_final_response()


def _one_response(events: list) -> None:
    """What any client may rely on: one response from ``created`` to ``completed``, its events
    numbered without gap or repeat, every item added once and done once."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds.count("response.created") == kinds.count("response.in_progress") == 1
    assert kinds[-1] in ("response.completed", "response.incomplete") and "error" not in kinds
    assert {e.response.id for e in events if e.type.startswith("response.") and hasattr(e, "response")} == {
        events[0].response.id
    }
    added = [(e.output_index, e.item.id) for e in events if e.type == "response.output_item.added"]
    done = [(e.output_index, e.item.id) for e in events if e.type == "response.output_item.done"]
    assert sorted(added) == sorted(done) and len({i for i, _ in added}) == len(added)


def _stopped_reference(survivor: Proc, text_of) -> tuple:
    """A greedy answer that ends completed (what the SDK's helper needs) at a stop string late in
    it, long enough (~1.5 s on CPU) that a victim is still writing when the client has read a few
    events; and its request (for the router)."""
    request = {"max_output_tokens": 800, "temperature": 0.0, "store": False}
    client = _client(survivor.url)
    text = text_of(
        client.responses.create(model=MODEL, input=PROMPT, extra_body={"ignore_eos": True}, **request)
    )
    at = next(i for i in range(len(text) * 2 // 3, 0, -1) if text.find(text[i : i + 8]) == i)
    request = {**request, "extra_body": {"ignore_eos": True, "stop": [text[at : at + 8]]}}
    reference = client.responses.create(model=MODEL, input=PROMPT, **request)
    assert reference.status == "completed" and text_of(reference) == text[:at]
    assert reference.usage.output_tokens > 400
    del request["store"]
    return reference, request


def _failed_over(cluster: Cluster, survivor: Proc, victim: Proc, request: dict) -> tuple:
    """A router over the two (round robin sends its first request to the victim), and the events
    and final response of a stream whose replica it kills part-way: failed over once, one response."""
    router = cluster.router(  # round_robin: the first request to the victim
        "--replica", victim.url, "--replica", survivor.url, "--policy", "round_robin", all_routable=True
    )
    events: list = []
    final = _killed_mid_stream(router, victim, events, **request)
    assert metric(router.url, "ferry:router_failovers_total") == 1
    _one_response(events)
    return router, events, final


def test_kill9_mid_text_stream_goes_on_as_one_stored_response(cluster: Cluster, replicas: list[Proc]) -> None:
    survivor, victim = replicas[0], replicas[1]
    reference, request = _stopped_reference(survivor, lambda r: r.output_text)
    router, events, final = _failed_over(cluster, survivor, victim, request)
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert {(e.item_id, e.output_index, e.content_index) for e in deltas} == {(final.output[0].id, 0, 0)}
    assert "".join(e.delta for e in deltas) == reference.output_text  # no duplicate, no gap
    (item,) = final.output
    assert item.type == "message" and item.content[0].text == reference.output_text
    assert final.id == events[0].response.id and final.created_at == events[0].response.created_at
    assert final.status == "completed"
    assert final.usage.output_tokens == reference.usage.output_tokens
    assert final.usage.input_tokens == reference.usage.input_tokens
    assert not any("ferry_chunk" in e.type or hasattr(e, "token_ids") for e in events)
    # Stored whole, under the id the client saw, by the replica that finished it: the router sends
    # what names it there, and the conversation goes on from it.
    client = _client(router.url)
    stored = client.responses.retrieve(final.id)
    assert stored.output_text == reference.output_text
    assert stored.usage.output_tokens == reference.usage.output_tokens
    follow = client.responses.create(
        model=MODEL, previous_response_id=final.id, input="And?", max_output_tokens=3
    )
    assert follow.status in ("completed", "incomplete")
    assert metric(router.url, "ferry:router_response_affinity_total", {"outcome": "hit"}) == 2
    assert wait_until(
        lambda: all(v["inflight"] == v["prefilling"] == 0 for v in replicas_view(router).values())
    )


def test_kill9_mid_function_call_goes_on_in_the_same_call(cluster: Cluster, replicas: list[Proc]) -> None:
    survivor, victim = replicas[0], replicas[2]
    request = {"max_output_tokens": 800, "temperature": 0.8, "extra_body": {"seed": 99}, **STORY_TOOL}
    reference = _client(survivor.url).responses.create(model=MODEL, input=PROMPT, store=False, **request)
    (expected,) = reference.output
    router, events, final = _failed_over(cluster, survivor, victim, request)
    (call,) = final.output
    assert call.type == "function_call" and call.name == "tell" and call.call_id.startswith("call_")
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert {(e.item_id, e.output_index) for e in deltas} == {(call.id, 0)}
    assert "".join(e.delta for e in deltas) == call.arguments == expected.arguments
    assert final.status == reference.status == "completed"
    assert final.usage.output_tokens == reference.usage.output_tokens


def test_a_chain_whose_previous_response_died_with_its_replica_ends_failed(
    cluster: Cluster, replicas: list[Proc]
) -> None:
    """Memory stores: a stream continuing a chain (``previous_response_id``) runs where that response
    is; when that replica dies, no other can read it (a 404 there), so the stream ends failed."""
    survivor, victim = replicas[0], replicas[3]
    router = cluster.router(  # round_robin: the first request to the victim
        "--replica", victim.url, "--replica", survivor.url, "--policy", "round_robin", all_routable=True
    )
    client = _client(router.url)
    first = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3)
    assert replicas_view(router)[victim.url]["total_requests"] == 1
    events: list = []
    request = {"max_output_tokens": 600, "temperature": 0.0, "extra_body": {"ignore_eos": True}}
    with pytest.raises(RuntimeError, match="response.completed"):
        _killed_mid_stream(router, victim, events, previous_response_id=first.id, **request)
    assert metric(router.url, "ferry:router_failovers_total") == 1  # tried, refused by the survivor
    kinds = [e.type for e in events]
    assert kinds[-2:] == ["error", "response.failed"] and "no replica could resume it" in events[-2].message
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].response.output[0].content[0].text == text


@pytest.fixture(scope="module")
def thinkers(cluster: Cluster) -> list[Proc]:
    """A survivor and a victim whose answers are all reasoning (deepseek_r1: thinking until a
    ``</think>`` this model never writes)."""
    return cluster.replicas(2, "--reasoning-parser", "deepseek_r1")


def test_kill9_mid_reasoning_goes_on_in_the_same_item(cluster: Cluster, thinkers: list[Proc]) -> None:
    survivor, victim = thinkers
    reference, request = _stopped_reference(survivor, lambda r: r.output[0].content[0].text)
    router, events, final = _failed_over(cluster, survivor, victim, request)
    (item,) = final.output
    deltas = [e for e in events if e.type == "response.reasoning_text.delta"]
    assert {(e.item_id, e.output_index) for e in deltas} == {(item.id, 0)}
    assert "".join(e.delta for e in deltas) == item.content[0].text == reference.output[0].content[0].text
    assert final.usage.output_tokens == reference.usage.output_tokens
