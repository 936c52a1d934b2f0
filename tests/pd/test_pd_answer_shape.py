"""A disaggregated chat answer is shaped as one replica shapes it: with ``--reasoning-parser`` the
prefill worker's token is reasoning where the replica's is (streamed and whole), and a stream with
``continuous_usage_stats`` has one role chunk, carrying ``usage`` as a replica's does.

The reference is the decode worker itself, which serves a plain request whole as a mixed replica
does. One prefill and one decode worker (both ``--reasoning-parser deepseek_r1``: the tiny model's
every answer is unfinished thinking) on the session's Redis tier; a PD router over them
(``--pd-threshold 0``: every request is handed off). The tracker's part is also checked alone.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from router.sse import StreamTracker
from tests.router.router_harness import Cluster, Proc, metric, replicas_view, wait_until

CHAT = "/v1/chat/completions"
PROMPTS = ("hello " * 12, "The quick brown fox " * 6, "def handle(request):\n    return")


@dataclass
class Workers:
    prefill: Proc
    decode: Proc  # also the reference
    router: Proc


@pytest.fixture(scope="module")
def pd(tiny_llama: Path, redis_server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workers]:
    redis_server.flush()
    cluster = Cluster(tiny_llama, tmp_path_factory.mktemp("pd-answer-shape"))
    flags = ("--kv-tier", redis_server.url, "--num-kv-blocks", "256", "--reasoning-parser", "deepseek_r1")
    try:
        (prefill,) = cluster.replicas(1, "--role", "prefill", *flags)
        (decode,) = cluster.replicas(1, "--role", "decode", *flags)
        router = cluster.router(
            "--model",
            str(tiny_llama),
            "--pd-threshold",
            "0",
            "--prefill",
            prefill.url,
            "--decode",
            decode.url,
        )
        assert wait_until(lambda: replicas_view(router)[prefill.url]["routable"])
        yield Workers(prefill, decode, router)
    finally:
        cluster.close()


def _body(prompt: str, **fields) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": 6, **fields}


def _chunks(url: str, body: dict) -> list[dict]:
    out = []
    with httpx.stream("POST", url + CHAT, json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


def _streamed(chunks: list[dict]) -> tuple[str, str]:
    """(reasoning, content) a client puts together from a stream's deltas."""
    reasoning = content = ""
    for c in chunks:
        for choice in c["choices"]:
            reasoning += choice["delta"].get("reasoning_content") or ""
            content += choice["delta"].get("content") or ""
    return reasoning, content


def _disaggregated(router: Proc) -> float:
    return metric(router.url, "ferry:router_pd_requests_total", {"path": "disaggregated"})


@pytest.mark.parametrize("prompt", PROMPTS)
def test_reasoning_of_a_whole_answer_includes_the_first_token(pd: Workers, prompt: str) -> None:
    before = _disaggregated(pd.router)
    got = httpx.post(pd.router.url + CHAT, json=_body(prompt), timeout=60).json()
    assert _disaggregated(pd.router) == before + 1
    want = httpx.post(pd.decode.url + CHAT, json=_body(prompt), timeout=60).json()
    assert got["choices"][0]["message"] == want["choices"][0]["message"]
    assert want["choices"][0]["message"]["content"] is None  # all of it is (unfinished) thinking
    assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"] == 6


def test_reasoning_of_a_stream_includes_the_first_token(pd: Workers) -> None:
    prompt = PROMPTS[0]  # its first token is a whole character (else a replica holds it back too)
    before = _disaggregated(pd.router)
    got = _streamed(_chunks(pd.router.url, _body(prompt, stream=True)))
    assert _disaggregated(pd.router) == before + 1
    want = _streamed(_chunks(pd.decode.url, _body(prompt, stream=True)))
    assert got == want
    assert want[0] and not want[1]


def test_continuous_usage_stream_has_one_role_chunk_with_usage(pd: Workers) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = _body(PROMPTS[1], stream=True, stream_options=options)
    before = _disaggregated(pd.router)
    got = _chunks(pd.router.url, body)
    assert _disaggregated(pd.router) == before + 1
    want = _chunks(pd.decode.url, body)
    roles = [c for c in got if c["choices"] and "role" in c["choices"][0]["delta"]]
    assert len(roles) == 1 and got[0] is roles[0]
    assert all("usage" in c for c in got)
    assert got[0]["usage"] == want[0]["usage"]  # the prompt counted, no completion token yet
    assert got[-1]["usage"] == want[-1]["usage"]
    assert [c["usage"]["completion_tokens"] for c in got if c["choices"]][-1] == 6


def test_tracker_drops_a_resumed_role_chunk_that_carries_usage() -> None:
    tracker = StreamTracker(chat=True, client_wants_token_ids=False)

    def event(obj: dict) -> bytes:
        return b"data: " + json.dumps(obj).encode()

    usage = {"prompt_tokens": 5, "completion_tokens": 0, "total_tokens": 5}
    role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
    head = {"id": "a", "created": 1, "object": "chat.completion.chunk"}
    assert tracker.process(event({**head, "choices": [role], "usage": usage})) is not None
    token = {"index": 0, "delta": {"content": "x"}, "token_ids": [7], "finish_reason": None}
    assert tracker.process(event({**head, "choices": [token], "usage": {**usage, "completion_tokens": 1}}))
    tracker.begin_failover()
    resumed = {**head, "id": "b", "choices": [role], "usage": usage}
    assert tracker.process(event(resumed)) is None  # the client has its role chunk already
    final = {**head, "id": "b", "choices": [], "usage": {**usage, "completion_tokens": 2}}
    out = tracker.process(event(final))
    assert out is not None and json.loads(out[6:])["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_opened_by_the_first_token_goes_on_after_the_hand_off(pd: Workers, stream: bool) -> None:
    """Under a constraint the answer thinks only if it opens with ``<think>``: the prefill worker's
    token starts that opening, and the decode worker must read what follows as its continuation."""
    body = _body(
        PROMPTS[1],
        max_tokens=30,
        structured_outputs={"regex": "<think>[a-f]{4}</think>[a-f]{3}"},
        stream=stream,
    )
    before = _disaggregated(pd.router)
    if stream:
        got, want = _streamed(_chunks(pd.router.url, body)), _streamed(_chunks(pd.decode.url, body))
    else:
        answers = [httpx.post(u + CHAT, json=body, timeout=60).json() for u in (pd.router.url, pd.decode.url)]
        got, want = (
            (a["choices"][0]["message"]["reasoning_content"], a["choices"][0]["message"]["content"])
            for a in answers
        )
    assert _disaggregated(pd.router) == before + 1
    assert got == want
    assert len(want[0]) == 4 and len(want[1]) == 3


@pytest.mark.parametrize("stream", [False, True])
def test_chat_echo_is_served_whole(pd: Workers, stream: bool) -> None:
    """Chat ``echo`` puts the last message's text before the first token: a hand-off would put the
    router's first token in front of it (whole) or lose it (streamed), so the decode worker serves
    it whole, as completions' ``echo``."""
    messages = [{"role": "user", "content": PROMPTS[1]}, {"role": "assistant", "content": "Sure"}]
    body = _body(
        "",
        messages=messages,
        echo=True,
        add_generation_prompt=False,
        continue_final_message=True,
        stream=stream,
    )
    before = metric(pd.router.url, "ferry:router_pd_local_prefill_total", {"reason": "echo"})
    if stream:
        got, want = _streamed(_chunks(pd.router.url, body)), _streamed(_chunks(pd.decode.url, body))
    else:
        answers = [httpx.post(u + CHAT, json=body, timeout=60).json() for u in (pd.router.url, pd.decode.url)]
        got, want = (a["choices"][0]["message"] for a in answers)
    assert got == want
    assert metric(pd.router.url, "ferry:router_pd_local_prefill_total", {"reason": "echo"}) == before + 1
    assert (want[1] if stream else want["content"]).startswith("Sure")


@pytest.mark.parametrize("stream", [False, True])
def test_a_continued_message_keeps_its_role_through_the_hand_off(pd: Workers, stream: bool) -> None:
    """A prompt that continues its last message answers in that message's role (vLLM's rule; a
    custom role here): the router's own role chunk takes it from the prefill worker's answer."""
    messages = [{"role": "user", "content": PROMPTS[2]}, {"role": "ipython", "content": "Sure"}]
    body = _body(
        "", messages=messages, add_generation_prompt=False, continue_final_message=True, stream=stream
    )
    before = _disaggregated(pd.router)
    if stream:
        got, want = _chunks(pd.router.url, body), _chunks(pd.decode.url, body)
        roles = [
            c["choices"][0]["delta"]["role"]
            for c in got
            if c["choices"] and "role" in c["choices"][0]["delta"]
        ]
        assert roles == ["ipython"] and want[0]["choices"][0]["delta"]["role"] == "ipython"
        assert _streamed(got) == _streamed(want)
    else:
        answers = [httpx.post(u + CHAT, json=body, timeout=60).json() for u in (pd.router.url, pd.decode.url)]
        got, want = (a["choices"][0]["message"] for a in answers)
        assert got == want and got["role"] == "ipython"
    assert _disaggregated(pd.router) == before + 1
