"""Failure handling against real replicas: kill -9 mid-stream failover (exact continuation),
retry before the first byte, ejection and readmission, replicas still starting, Redis discovery,
and vLLM's tokens-in/tokens-out generate (whole answers retried, streams resumed)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
import redis
from router_harness import Cluster, Proc, free_port, metric, replica_args, replicas_view, wait_until

from router.discovery_redis import departed_key, replica_key, replica_value

MODEL = "llama"


@pytest.fixture(scope="module")
def trio(cluster: Cluster) -> list[Proc]:
    """A survivor and six victims (one per failover test), loaded together."""
    return cluster.replicas(7)


# A named tool whose arguments cannot be complete within the budget: the call streams until length.
STORY_TOOL = {
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "tell",
                "parameters": {
                    "type": "object",
                    "properties": {"story": {"type": "string", "minLength": 5000}},
                    "required": ["story"],
                },
            },
        }
    ],
    "tool_choice": {"type": "function", "function": {"name": "tell"}},
}


# What the streams of test_kill9_mid_stream_fails_over_exactly ask for besides their text.
PROMPT_FIELDS = {
    "chat": {"return_token_ids": True, "return_prompt_text": True},
    "completions": {"return_token_ids": True},
}


def _prompt_fields(url: str, kind: str) -> dict:
    """The prompt fields a replica shows for the test's prompt: its /tokenize ids, and for chat the
    text of a whole answer's ``prompt_text`` (whose ids are the same)."""
    if kind == "completions":
        return {
            "prompt_token_ids": httpx.post(url + "/tokenize", json={"prompt": "Once upon a time"}).json()[
                "tokens"
            ]
        }
    messages = [{"role": "user", "content": "Write a long story."}]
    ids = httpx.post(url + "/tokenize", json={"messages": messages}).json()["tokens"]
    whole = httpx.post(
        url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 1, **PROMPT_FIELDS["chat"]}
    ).json()
    assert whole["prompt_token_ids"] == ids
    return {"prompt_token_ids": ids, "prompt_text": whole["prompt_text"]}


def _reference(url: str, kind: str, max_tokens: int, sampling: dict) -> tuple[str, str]:
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    if kind == "tool":
        r = c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Write a long story."}],
            max_tokens=max_tokens,
            **STORY_TOOL,
            **sampling,
        )
        (call,) = r.choices[0].message.tool_calls
        return call.function.arguments, r.choices[0].finish_reason
    if kind == "chat":
        r = c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Write a long story."}],
            max_tokens=max_tokens,
            extra_body={"ignore_eos": True},
            **sampling,
        )
        return r.choices[0].message.content, r.choices[0].finish_reason
    r = c.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=max_tokens,
        extra_body={"ignore_eos": True},
        **sampling,
    )
    return r.choices[0].text, r.choices[0].finish_reason


@pytest.mark.parametrize(
    ("kind", "sampling", "victim_index"),
    [
        ("chat", {"temperature": 0}, 1),
        ("completions", {"temperature": 0.8, "seed": 1234}, 2),
        ("tool", {"temperature": 0.8, "seed": 99}, 3),
    ],
    ids=["greedy-chat", "seeded-completions", "seeded-named-tool-call"],
)
def test_kill9_mid_stream_fails_over_exactly(
    cluster: Cluster, trio: list[Proc], kind: str, sampling: dict, victim_index: int
) -> None:
    survivor, victim = trio[0], trio[victim_index]
    max_tokens = 400
    expected_text, expected_finish = _reference(survivor.url, kind, max_tokens, sampling)
    router = cluster.router(  # round_robin: the first request to the victim
        "--replica", victim.url, "--replica", survivor.url, "--policy", "round_robin", all_routable=True
    )
    c = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=60)
    opts = {
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "extra_body": {"ignore_eos": True, **PROMPT_FIELDS.get(kind, {})},
        **sampling,
    }
    with victim.throttle() as throttle:
        if kind == "tool":
            # The resumed replica's grammar takes the tokens already sent, and its tool state the text:
            # the call's id and name are not sent twice, its arguments continue exactly.
            del opts["extra_body"]
            stream = c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Write a long story."}],
                **STORY_TOOL,
                **opts,
            )
        elif kind == "chat":
            stream = c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Write a long story."}], **opts
            )
        else:
            stream = c.completions.create(model=MODEL, prompt="Once upon a time", **opts)
        pieces, finishes, usage, ids, roles, headers = [], [], None, set(), 0, []
        prompts = []  # (chunk number, the prompt fields it carried)
        killer: threading.Timer | None = None
        for number, chunk in enumerate(stream):
            ids.add(chunk.id)
            fields = {k: v for k, v in chunk.model_extra.items() if k in ("prompt_token_ids", "prompt_text")}
            fields.update(
                (k, v) for ch in chunk.choices for k, v in ch.model_extra.items() if k == "prompt_token_ids"
            )
            if fields:
                prompts.append((number, fields))
            if chunk.usage is not None:
                usage = chunk.usage
            for ch in chunk.choices:
                if kind == "tool":
                    assert not ch.delta.content
                    for d in ch.delta.tool_calls or []:
                        assert d.index == 0
                        if d.id or d.function.name:
                            headers.append((d.id, d.function.name))
                        pieces.append(d.function.arguments or "")
                    roles += 1 if ch.delta.role else 0
                elif kind == "chat":
                    pieces.append(ch.delta.content or "")
                    roles += 1 if ch.delta.role else 0
                else:
                    pieces.append(ch.text)
                if ch.finish_reason:
                    finishes.append(ch.finish_reason)
            if killer is None and "".join(pieces):
                # The victim is serving it, past its first content. Freeze it at once and kill it a
                # moment later: it runs throttled, so a loaded client cannot fall a whole answer behind.
                killer = throttle.freeze_then_kill()
                assert replicas_view(router)[victim.url]["inflight"] == 1
    assert killer is not None
    killer.join()
    assert metric(router.url, "ferry:router_failovers_total") == 1
    assert "".join(pieces) == expected_text  # no duplicate, no gap
    assert finishes == [expected_finish] == ["length"]
    assert usage.completion_tokens == max_tokens and usage.total_tokens == usage.prompt_tokens + max_tokens
    assert len(ids) == 1  # one stream id from start to end
    # Both replicas' load given back, the survivor's prefill count included (its first content
    # came after the client's).
    assert wait_until(
        lambda: all(v["inflight"] == v["prefilling"] == 0 for v in replicas_view(router).values())
    )
    assert roles in (0, 1) and (kind == "completions" or roles == 1)
    if kind == "tool":
        assert len(headers) == 1 and headers[0][0].startswith("call_") and headers[0][1] == "tell"
    # vLLM's prompt fields, asked for: once, on the first chunk, the original prompt's (the resumed
    # replica's prompt goes on with the tokens sent; its own opening fields are not relayed). Not
    # asked (the tool call): never, though the router asks every replica for token ids.
    assert prompts == ([(0, _prompt_fields(survivor.url, kind))] if kind in PROMPT_FIELDS else [])


def test_kill9_mid_messages_stream_fails_over_exactly(cluster: Cluster, trio: list[Proc]) -> None:
    """Anthropic's Messages API through the router: the stream a killed replica was writing goes on
    from another replica, one message, one text block, the whole answer's output tokens."""
    survivor, victim = trio[0], trio[4]
    request = {
        "model": MODEL,
        "max_tokens": 300,
        "messages": [{"role": "user", "content": "Write a long story."}],
        # Greedy: Anthropic's API has no seed, and exactness across replicas needs one to sample.
        "temperature": 0.0,
    }
    reference = httpx.post(survivor.url + "/v1/messages", json=request, timeout=120).json()
    (expected,) = reference["content"]
    assert reference["usage"]["output_tokens"] > 20  # long enough to be cut mid-way
    router = cluster.router(  # round_robin: the first request to the victim
        "--replica", victim.url, "--replica", survivor.url, "--policy", "round_robin", all_routable=True
    )
    events = []
    killer: threading.Timer | None = None
    with (
        victim.throttle() as throttle,
        httpx.stream("POST", router.url + "/v1/messages", json={**request, "stream": True}, timeout=120) as r,
    ):
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        kind = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                assert event["type"] == kind
                events.append(event)
                if killer is None and event["type"] == "content_block_delta":
                    # Frozen at its first text, killed a moment later (as above).
                    killer = throttle.freeze_then_kill()
                    assert replicas_view(router)[victim.url]["inflight"] == 1
    assert killer is not None
    killer.join()
    assert metric(router.url, "ferry:router_failovers_total") == 1
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds.count("message_start") == 1
    assert kinds[-2:] == ["message_delta", "message_stop"] and "error" not in kinds
    assert "ferry_chunk" not in kinds and not any("token_ids" in e for e in events)
    starts = [e for e in events if e["type"] == "content_block_start"]
    stops = [e for e in events if e["type"] == "content_block_stop"]
    assert [s["index"] for s in starts] == [s["index"] for s in stops] == [0]
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert {e["index"] for e in events if e["type"] == "content_block_delta"} == {0}
    assert text == expected["text"]  # no duplicate, no gap
    final = events[-2]
    assert final["delta"]["stop_reason"] == reference["stop_reason"]
    assert final["usage"]["output_tokens"] == reference["usage"]["output_tokens"]
    assert wait_until(lambda: all(v["inflight"] == 0 for v in replicas_view(router).values()))


def _generate_reference(url: str) -> tuple[dict, list[int]]:
    """A greedy generate body of 300 tokens and the token ids ``url`` answers it with."""
    prompt = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": "Once upon a time"}).json()
    params = {"max_tokens": 300, "temperature": 0, "ignore_eos": True}
    body = {"model": MODEL, "token_ids": prompt["tokens"], "sampling_params": params}
    answer = httpx.post(url + "/inference/v1/generate", json=body, timeout=120).json()
    (choice,) = answer["choices"]
    assert len(choice["token_ids"]) == 300 and choice["finish_reason"] == "length"
    return body, choice["token_ids"]


def test_kill9_mid_generate_retries_the_whole_answer(cluster: Cluster, trio: list[Proc]) -> None:
    """vLLM's generate, answered whole: a replica killed while generating it is one more retry, on
    the survivor, and the client gets the very token ids a greedy run gives."""
    survivor, victim = trio[0], trio[5]
    body, expected = _generate_reference(survivor.url)
    router = cluster.router(  # round_robin: the first request to the victim
        "--replica", victim.url, "--replica", survivor.url, "--policy", "round_robin", all_routable=True
    )
    got: list[httpx.Response] = []
    with victim.throttle() as throttle:
        asked = threading.Thread(
            target=lambda: got.append(
                httpx.post(router.url + "/inference/v1/generate", json=body, timeout=120)
            )
        )
        asked.start()
        assert wait_until(lambda: replicas_view(router)[victim.url]["inflight"] == 1)
        throttle.freeze_then_kill().join()
        asked.join()
    (r,) = got
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["token_ids"] == expected and choice["finish_reason"] == "length"
    assert metric(router.url, "ferry:router_retries_total") == 1
    assert metric(router.url, "ferry:router_requests_total", {"replica": survivor.url, "status": "200"}) == 1
    assert wait_until(lambda: all(v["inflight"] == 0 for v in replicas_view(router).values()))


def test_kill9_mid_generate_stream_resumes_exactly(cluster: Cluster, trio: list[Proc]) -> None:
    """vLLM's generate, streamed: each chunk carries its token ids, so a stream whose replica dies
    part-way is resumed on the survivor (``resume`` after the ids sent) and the client gets exactly
    the greedy run's 300 ids, one ``request_id`` throughout, then ``[DONE]``."""
    survivor, victim = trio[0], trio[6]
    body, expected = _generate_reference(survivor.url)
    router = cluster.router(  # round_robin: the first request to the victim
        "--replica", victim.url, "--replica", survivor.url, "--policy", "round_robin", all_routable=True
    )
    events: list[str] = []
    killer: threading.Timer | None = None
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    stream = httpx.stream("POST", router.url + "/inference/v1/generate", json=body, timeout=120)
    with victim.throttle() as throttle, stream as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if killer is None:  # frozen at its first tokens, killed a moment later
                    killer = throttle.freeze_then_kill()
                    assert replicas_view(router)[victim.url]["inflight"] == 1
    assert killer is not None
    killer.join()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks), chunks[-3:]
    assert [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]] == expected
    assert [ch["finish_reason"] for c in chunks for ch in c["choices"]][-1] == "length"
    assert len({c["request_id"] for c in chunks}) == 1
    assert chunks[-1]["usage"]["completion_tokens"] == 300  # the whole stream's, not the survivor's
    assert metric(router.url, "ferry:router_failovers_total") == 1
    assert wait_until(lambda: all(v["inflight"] == 0 for v in replicas_view(router).values()))


def test_starting_replica_retry_ejection_and_readmission(cluster: Cluster, trio: list[Proc]) -> None:
    survivor = trio[0]
    port = free_port()
    late = f"http://127.0.0.1:{port}"
    router = cluster.router(
        "--replica", late, "--replica", survivor.url, "--policy", "round_robin", "--health-interval", "0.5"
    )
    view = replicas_view(router)[late]
    assert view["health"] == "starting" and view["failures"] == 0
    for _ in range(2):  # only the survivor takes traffic meanwhile
        assert (
            httpx.post(
                router.url + "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 1}
            ).status_code
            == 200
        )
    time.sleep(1.0)
    view = replicas_view(router)[late]
    assert view["health"] == "starting" and view["failures"] == 0  # refused connections were not errors

    proc = Proc(replica_args(cluster.model, port), port, cluster.tmp / f"late-{port}.log").start()
    cluster.procs.append(proc)
    proc.wait_http()
    assert wait_until(lambda: replicas_view(router)[late]["health"] == "healthy", timeout=60)

    # Dies while healthy: the next request to it fails to connect and is retried on the survivor.
    proc.kill9()
    retries_before = metric(router.url, "ferry:router_retries_total")
    statuses = [
        httpx.post(
            router.url + "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 1}, timeout=30
        ).status_code
        for _ in range(2)
    ]
    assert statuses == [200, 200]
    assert metric(router.url, "ferry:router_retries_total") == retries_before + 1
    assert replicas_view(router)[late]["health"] == "ejected"
    assert metric(router.url, "ferry:router_replica_healthy", {"replica": late}) == 0 or wait_until(
        lambda: metric(router.url, "ferry:router_replica_healthy", {"replica": late}) == 0
    )

    # Restarted: the prober readmits it and it takes its share again.
    proc = Proc(replica_args(cluster.model, port), port, cluster.tmp / f"late2-{port}.log").start()
    cluster.procs.append(proc)
    proc.wait_http()
    assert wait_until(lambda: replicas_view(router)[late]["health"] == "healthy", timeout=60)
    before = replicas_view(router)[late]["total_requests"]
    for _ in range(4):
        httpx.post(router.url + "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 1})
    assert replicas_view(router)[late]["total_requests"] - before == 2


def test_redis_discovery_add_and_remove(cluster: Cluster, trio: list[Proc], redis_url: str) -> None:
    survivor = trio[0]
    router = cluster.router(
        "--discovery", redis_url, "--discovery-interval", "0.3", "--policy", "round_robin"
    )
    assert httpx.get(router.url + "/health").status_code == 503
    # A real replica registering itself.
    port = free_port()
    reg = Proc(
        replica_args(cluster.model, port, "--register", redis_url), port, cluster.tmp / f"reg-{port}.log"
    )
    cluster.procs.append(reg.start())
    reg.wait_http()
    assert wait_until(lambda: httpx.get(router.url + "/health").status_code == 200, timeout=60)
    assert replicas_view(router)[reg.url]["source"] == "discovery"
    ok = httpx.post(router.url + "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2})
    assert ok.status_code == 200
    # An entry whose heartbeat stops disappears by itself when its TTL runs out (a TTL cut short
    # once the router has it: with a short one from the start, a router polling late on a loaded
    # machine never saw it).
    r = redis.Redis.from_url(redis_url)
    r.set(replica_key(survivor.url), replica_value(survivor.url, "mixed", MODEL, time.time()), px=60000)
    assert wait_until(lambda: survivor.url in replicas_view(router), timeout=60)
    r.pexpire(replica_key(survivor.url), 500)
    assert wait_until(lambda: survivor.url not in replicas_view(router), timeout=60)
    # Malformed entries are ignored, never fatal.
    r.set(replica_key("http://bad"), b"{not json", px=5000)
    # So is one whose URL the relay could not use; it stays while the rest of discovery goes on.
    bad_url = replica_key("http://[::1")
    r.set(bad_url, replica_value("http://[::1", "mixed", MODEL, time.time()), px=60000)
    # Clean shutdown deletes the key: the router drops the replica.
    reg.stop()
    assert wait_until(lambda: reg.url not in replicas_view(router), timeout=60)
    assert r.exists(departed_key(reg.url))  # deregistered, not left to its TTL
    assert httpx.get(router.url + "/health").status_code == 503
    r.delete(bad_url)
