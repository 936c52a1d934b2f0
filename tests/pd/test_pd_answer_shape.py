"""A disaggregated chat answer is shaped as one replica shapes it: with ``--reasoning-parser`` the
prefill worker's token is reasoning where the replica's is (streamed and whole), and a stream with
``continuous_usage_stats`` has one role chunk, carrying ``usage`` as a replica's does; across the
fields a client sends (sampling with a seed, penalties, stops at the hand-off's boundary, an end by the
prefill worker's token, ``min_tokens``, token ids, usage) the answer, whole and streamed, is the
replica's, its stream has the replica's headers and no chunk that shows nothing.

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
            # vLLM's two names for it, the same text in every delta (the router's first one too).
            assert choice["delta"].get("reasoning") == choice["delta"].get("reasoning_content")
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


# ---- parity with one replica across the request's fields ----------------------------------------
COMPLETIONS = "/v1/completions"
_VOLATILE = ("id", "created")  # a fresh id and clock per answer; everything else must agree


def _events(url: str, path: str, body: dict) -> list[dict | str]:
    with httpx.stream("POST", url + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        return [
            line[6:] if line == "data: [DONE]" else json.loads(line[6:])
            for line in r.iter_lines()
            if line.startswith("data: ")
        ]


def _assembled(events: list[dict | str]) -> dict:
    """What a client builds from a stream (text, ids, ends, usage, the prompt fields) and its framing:
    one role chunk, at most one usage chunk, the prompt fields on the first chunk only, ``[DONE]``
    last. Chunk boundaries are the replica's batching, not part of the answer, so they are not compared."""
    out: dict = {"text": "", "reasoning": "", "token_ids": [], "finish": [], "roles": [], "usage": []}
    out["prompt"] = []
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    for e in events[:-1]:
        assert isinstance(e, dict) and "error" not in e
        choice_ids = [c["prompt_token_ids"] for c in e["choices"] if "prompt_token_ids" in c]
        fields = {k: e[k] for k in ("prompt_token_ids", "prompt_text") if k in e} or choice_ids
        if fields:
            assert e is events[0]
            out["prompt"].append(fields)
        if e.get("usage") and not e["choices"]:
            out["usage"].append(e["usage"])
        for c in e["choices"]:
            delta = c.get("delta", {})
            out["roles"] += [delta["role"]] if "role" in delta else []
            out["text"] += delta.get("content") or c.get("text") or ""
            out["reasoning"] += delta.get("reasoning_content") or ""
            out["token_ids"] += c.get("token_ids") or []
            if c["finish_reason"]:
                out["finish"].append((c["finish_reason"], c.get("stop_reason")))
    return out


def _whole(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return {k: v for k, v in r.json().items() if k not in _VOLATILE}


def _text(answer: dict) -> str:
    choice = answer["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["reasoning_content"]


def _boundary_stop(pd: Workers, path: str, body: dict) -> str:
    """A stop string that starts in the first token's text and ends in the second's."""
    first = _text(_whole(pd.decode.url, path, {**body, "max_tokens": 1}))
    rest = _text(_whole(pd.decode.url, path, {**body, "max_tokens": 2}))[len(first) :]
    assert first and rest
    return first[-1] + rest[0]


# (name, extra fields): each is sent streamed and whole to the router and to the reference.
PARITY_CASES = [
    ("plain", {}),
    ("seeded_sampling", {"temperature": 1.0, "top_p": 0.9, "top_k": 20, "seed": 11}),
    ("penalties", {"frequency_penalty": 1.5, "presence_penalty": 0.5, "repetition_penalty": 1.3}),
    ("token_ids", {"return_token_ids": True}),
    # vLLM's prompt fields (return_prompt_text is chat's; a completions replica ignores it), once: the
    # prefill worker's, whether the decode worker goes on or the prefill's token ended the answer.
    ("prompt_fields", {"return_token_ids": True, "return_prompt_text": True}),
    (
        "eos_first_prompt_fields",
        {"logit_bias": {"2": 100}, "return_token_ids": True, "return_prompt_text": True},
    ),
    ("eos_first", {"logit_bias": {"2": 100}}),  # the prefill worker's token ends the answer
    ("eos_after_min_tokens", {"logit_bias": {"2": 100}, "min_tokens": 3}),
    ("stop_at_the_boundary", {"stop": "boundary"}),
    ("stop_at_the_boundary_included", {"stop": "boundary", "include_stop_str_in_output": True}),
    ("single_token", {"max_tokens": 1}),  # not handed off: the whole answer is the prefill
]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("case", PARITY_CASES, ids=[c[0] for c in PARITY_CASES])
def test_an_answer_is_what_one_replica_answers(pd: Workers, path: str, case: tuple[str, dict]) -> None:
    name, extra = case
    base = {"prompt": PROMPTS[1]} if path == COMPLETIONS else {"messages": _body(PROMPTS[1])["messages"]}
    body = {**base, "temperature": 0, "max_tokens": 8, **extra}
    if extra.get("stop") == "boundary":
        body["stop"] = [_boundary_stop(pd, path, body)]
    handed_off = name != "single_token"
    # cached_tokens is the prefill worker's, the reference's its own: both have seen the prompt now.
    _whole(pd.router.url, path, body)
    before = _disaggregated(pd.router)
    got, want = _whole(pd.router.url, path, body), _whole(pd.decode.url, path, body)
    assert got == want
    options = {"include_usage": True}
    streamed = {**body, "stream": True, "stream_options": options}
    got_s, want_s = (_assembled(_events(u, path, streamed)) for u in (pd.router.url, pd.decode.url))
    assert got_s == want_s
    assert _disaggregated(pd.router) == before + 2 * handed_off
    assert got_s["usage"] == [got["usage"]]  # one usage chunk, the whole answer's
    assert got_s["roles"] == (["assistant"] if path == CHAT else [])
    tokenized = httpx.post(pd.decode.url + "/tokenize", json=base, timeout=60).json()["tokens"]
    if extra.get("return_token_ids"):  # the prompt's ids (and chat's text, if asked) once, on the first chunk
        shown = got["prompt_token_ids"] if path == CHAT else got["choices"][0]["prompt_token_ids"]
        assert shown == tokenized
        assert ("prompt_text" in got) == (path == CHAT and "return_prompt_text" in extra)
        fields = {k: got[k] for k in ("prompt_token_ids", "prompt_text") if k in got}
        assert got_s["prompt"] == [fields if path == CHAT else [shown]]
    else:  # the router asks the decode worker for token ids itself: the prompt's never reach the client
        assert got_s["prompt"] == [] and "prompt_token_ids" not in json.dumps(got)
    if name.startswith("stop"):
        assert want["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("prompt", PROMPTS, ids=["hello", "fox", "code"])
def test_a_stream_sends_no_chunk_that_shows_nothing(pd: Workers, path: str, prompt: str) -> None:
    """A replica sends no chunk for a token that completes no character yet (unless the client asked
    for its ids, logprobs or continuous usage); the router asks for ids to resume a stream, and must
    not pass on the empty chunks that brings, nor write one for a first token with no text."""
    base = {"prompt": prompt} if path == COMPLETIONS else {"messages": _body(prompt)["messages"]}
    body = {**base, "temperature": 0, "max_tokens": 24, "stream": True}
    before = _disaggregated(pd.router)
    events = _events(pd.router.url, path, body)
    assert _disaggregated(pd.router) == before + 1
    shown = []
    for e in events[:-1]:
        (c,) = e["choices"]
        delta = c.get("delta", {})
        shown.append(bool(c["finish_reason"] or "role" in delta or any(delta.values()) or c.get("text")))
    assert all(shown)
    assert _assembled(events) == _assembled(_events(pd.decode.url, path, body))


def test_a_stream_has_a_replicas_headers(pd: Workers) -> None:
    """The router writes a handed-off stream's headers itself: they must be a replica's, with
    ``x-accel-buffering: no`` (else a proxy such as nginx holds the first token back)."""
    body = {**_body(PROMPTS[1]), "stream": True}
    names = ("content-type", "cache-control", "x-accel-buffering")
    before = _disaggregated(pd.router)
    got, want = [], []
    for url, out in ((pd.router.url, got), (pd.decode.url, want)):
        with httpx.stream("POST", url + CHAT, json=body, timeout=60) as r:
            r.read()
            out += [r.headers.get(n) for n in names]
    assert _disaggregated(pd.router) == before + 1
    assert got == want == ["text/event-stream; charset=utf-8", "no-cache", "no"]
