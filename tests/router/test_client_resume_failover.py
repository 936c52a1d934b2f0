"""A client's own ``resume`` (ferry's field: a router in front of this one sends it on its
failovers) is honoured by the router as a replica honours it, also when the replica serving the
stream dies: the router's own resume goes on after the client's tokens and the ones it relayed,
so the stream the client gets is the one a replica alone would have sent."""

from __future__ import annotations

import json
import threading

import httpx
from router_harness import Cluster, metric, replicas_view

PROMPT = "Once upon a time"


def _stream(url: str, body: dict, on_content=None) -> tuple[list[int], dict | None]:
    """A completions stream's token ids and final usage; ``on_content`` runs at its first text."""
    ids: list[int] = []
    usage = None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            assert "error" not in obj, obj
            usage = obj.get("usage") or usage
            for c in obj["choices"]:
                ids += c["token_ids"]
                if on_content is not None and c["text"]:
                    on_content()
                    on_content = None
    return ids, usage


def test_kill9_mid_stream_resumes_after_the_clients_own_resume(cluster: Cluster) -> None:
    survivor, victim = cluster.replicas(2)
    common = {"prompt": PROMPT, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    start = httpx.post(survivor.url + "/v1/completions", json={**common, "max_tokens": 3}, timeout=60)
    resume = {"token_ids": start.json()["choices"][0]["token_ids"]}
    body = {
        **common,
        "max_tokens": 150,
        "resume": resume,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    expected, expected_usage = _stream(survivor.url, body)
    assert len(expected) == expected_usage["completion_tokens"] == 147  # the resumed 3 count in max_tokens

    router = cluster.router(  # round_robin: the first request to the victim
        "--replica", victim.url, "--replica", survivor.url, "--policy", "round_robin", all_routable=True
    )
    killer: list[threading.Timer] = []

    def kill() -> None:
        assert replicas_view(router)[victim.url]["inflight"] == 1
        killer.append(victim.freeze_then_kill())

    got, usage = _stream(router.url, body, kill)
    assert killer
    killer[0].join()
    assert metric(router.url, "ferry:router_failovers_total") == 1
    assert got == expected  # no gap, no duplicate: continued after the client's tokens and the sent ones
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # (cached_tokens: each replica's own)
    assert [usage[k] for k in counts] == [expected_usage[k] for k in counts]


def _messages_stream(url: str, body: dict, on_content=None) -> tuple[str, int]:
    """A Messages stream's text and its final ``output_tokens``."""
    text, output_tokens = "", -1
    with httpx.stream("POST", url + "/v1/messages", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            assert event["type"] != "error", event
            if event["type"] == "content_block_delta":
                text += event["delta"]["text"]
                if on_content is not None:
                    on_content()
                    on_content = None
            elif event["type"] == "message_delta":
                output_tokens = event["usage"]["output_tokens"]
    return text, output_tokens


def test_kill9_mid_messages_stream_resumes_after_the_clients_own_resume(cluster: Cluster) -> None:
    survivor, victim = cluster.replicas(2)
    messages = [{"role": "user", "content": "Write a long story."}]
    first = httpx.post(
        survivor.url + "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 3, "temperature": 0, "return_token_ids": True},
        timeout=60,
    )
    resume = {"token_ids": first.json()["choices"][0]["token_ids"]}
    body = {"model": "llama", "max_tokens": 150, "messages": messages, "temperature": 0.0}
    body.update(stream=True, resume=resume)
    expected = _messages_stream(survivor.url, body)
    assert len(expected[0]) > 20

    router = cluster.router(  # round_robin: the first request to the victim
        "--replica", victim.url, "--replica", survivor.url, "--policy", "round_robin", all_routable=True
    )
    killer: list[threading.Timer] = []

    def kill() -> None:
        assert replicas_view(router)[victim.url]["inflight"] == 1
        killer.append(victim.freeze_then_kill())

    got = _messages_stream(router.url, body, kill)
    assert killer
    killer[0].join()
    assert metric(router.url, "ferry:router_failovers_total") == 1
    assert got == expected


def test_responses_stream_with_the_clients_own_resume_is_not_failed_over(cluster: Cluster) -> None:
    """A Responses resume carries the client's view of the response (its items), which the router
    does not follow: such a stream is relayed without failover. Resumed from the client's own resume
    again, the new replica would repeat what the client already got from the killed one."""
    victim, survivor = cluster.replicas(2)
    router = cluster.router(  # round_robin: the first request to the victim
        "--replica", victim.url, "--replica", survivor.url, "--policy", "round_robin", all_routable=True
    )
    body = {
        "model": "llama",
        "input": "Write a long story.",
        "max_output_tokens": 150,
        "temperature": 0,
        "stream": True,
        "resume": {"token_ids": [], "output": [], "created_at": 1},
    }

    def events(url: str, on_event=None) -> list[dict]:
        got: list[dict] = []
        with httpx.stream("POST", url + "/v1/responses", json=body, timeout=120) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    got.append(json.loads(line[6:]))
                    if on_event is not None:
                        on_event(got)
        return got

    def text(got: list[dict]) -> str:
        return "".join(e["delta"] for e in got if e["type"] == "response.output_text.delta")

    reference = text(events(survivor.url))  # greedy: what any replica answers from the start

    def kill_after_two_deltas(got: list[dict]) -> None:
        if sum(e["type"] == "response.output_text.delta" for e in got) == 2 and victim.proc.poll() is None:
            victim.freeze_then_kill().join()

    got = events(router.url, kill_after_two_deltas)
    assert metric(router.url, "ferry:router_failovers_total") == 0
    # The stream ends as an unresumable one does, with what the client had from the killed replica
    # (the deltas it sent before it froze, however many were in flight): one item, and its text the
    # start of the answer, not the start again as a replica resumed from the client's resume would.
    kinds = [e["type"] for e in got]
    assert kinds.count("response.output_item.added") == 1 and kinds[-1] == "error"
    assert kinds.count("response.output_text.delta") >= 2
    assert len(text(got)) < len(reference) and reference.startswith(text(got))
