"""Streams of ``n`` > 1 choices resumed on another replica after kill -9: each choice goes on after
its own tokens (``resume.choices``), a choice that finished before the failure is not sent again,
and the client gets exactly the text, finish reasons and usage of an unbroken run.

Also the replica side of that contract: a ``resume.choices`` request runs only the choices it
lists, each continuing its unbroken run exactly (seeded sampling at the choice's own seed).
"""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
from router_harness import Cluster, Proc, metric, replicas_view, wait_until

MODEL = "llama"
PROMPT = "Once upon a time"
SEEDED = {"temperature": 0.8, "seed": 1234}


@pytest.fixture(scope="module")
def replicas(cluster: Cluster) -> list[Proc]:
    """A survivor (also the reference) and two victims, loaded together."""
    return cluster.replicas(3)


def _stream(url: str, path: str, body: dict) -> tuple[dict[int, list[int]], dict[int, str], dict, dict]:
    """Per choice index: token ids, text and finish reason; and the usage, of a raw SSE stream."""
    ids: dict[int, list[int]] = {}
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    usage: dict = {}
    body = {"model": MODEL, "stream": True, "stream_options": {"include_usage": True}, **body}
    with httpx.stream("POST", url + path, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            usage = obj.get("usage") or usage
            for c in obj["choices"]:
                i = c["index"]
                ids.setdefault(i, []).extend(c.get("token_ids") or [])
                texts[i] = texts.get(i, "") + (c.get("text") or (c.get("delta") or {}).get("content") or "")
                if c.get("finish_reason"):
                    assert i not in finishes, f"choice {i} finished twice"
                    finishes[i] = c["finish_reason"]
    return ids, texts, finishes, usage


# ---- the replica's contract --------------------------------------------------------------------


def test_replica_runs_only_the_listed_choices_each_after_its_own_tokens(replicas: list[Proc]) -> None:
    url = replicas[0].url
    body = {
        "prompt": PROMPT,
        "n": 3,
        "max_tokens": 12,
        "ignore_eos": True,
        "return_token_ids": True,
        **SEEDED,
    }
    ref_ids, ref_texts, _, ref_usage = _stream(url, "/v1/completions", body)
    assert len(set(map(tuple, ref_ids.values()))) == 3  # seeded choices differ: a swap would show
    resume = {"choices": [{"index": 2, "token_ids": []}, {"index": 1, "token_ids": ref_ids[1][:5]}]}
    ids, texts, finishes, usage = _stream(url, "/v1/completions", {**body, "resume": resume})
    assert ids == {1: ref_ids[1][5:], 2: ref_ids[2]}  # choice 0 finished before: it does not run
    assert texts[2] == ref_texts[2]
    assert finishes == {1: "length", 2: "length"}
    # What this replica produced (a router counts the resumed tokens itself), the prompt counted
    # once though the prompt's first choice did not run.
    assert usage["prompt_tokens"] == ref_usage["prompt_tokens"] > 0
    assert usage["completion_tokens"] == 7 + 12
    # The n = 1 form is unchanged.
    one = {**body, "n": 1, "resume": {"token_ids": ref_ids[0][:4]}}
    assert _stream(url, "/v1/completions", one)[0] == {0: ref_ids[0][4:]}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"n": 2, "stream": False, "resume": {"choices": [{"index": 0, "token_ids": [5]}]}},
            "resume.choices",
        ),
        ({"n": 2, "stream": True, "resume": {"choices": [{"index": 2, "token_ids": [5]}]}}, "resume.choices"),
        ({"n": 2, "stream": True, "resume": {"token_ids": [5]}}, "resume"),
    ],
    ids=["whole-answer", "index-out-of-range", "token-ids-form-with-n-2"],
)
def test_replica_refuses_resume_choices_it_cannot_honour(
    replicas: list[Proc], body: dict, param: str
) -> None:
    r = httpx.post(
        replicas[0].url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, **body}, timeout=30
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    both = {"choices": [{"index": 0, "token_ids": [5]}], "token_ids": [5]}
    r = httpx.post(
        replicas[0].url + "/v1/completions",
        json={"model": MODEL, "prompt": PROMPT, "n": 1, "stream": True, "resume": both},
        timeout=30,
    )
    assert 400 <= r.status_code < 500 and "exactly one of token_ids and choices" in r.text


# ---- the router's failover ----------------------------------------------------------------------


def _stop_ending_choice_0(url: str, body: dict) -> str:
    """A stop string that ends choice 0 within its first words and no other choice."""
    _, texts, _, _ = _stream(url, "/v1/completions", {**body, "ignore_eos": True})
    others = texts[1] + texts[2]
    for start in range(4, 40):
        s = texts[0][start : start + 3]
        if len(s) == 3 and s.strip() and s not in others and s not in texts[0][:start]:
            return s
    raise AssertionError(f"no stop string found in {texts!r}")


@pytest.mark.parametrize(
    ("kind", "victim_index"), [("seeded-completions-with-a-finished-choice", 1), ("greedy-chat", 2)]
)
def test_kill9_mid_n_choice_stream_fails_over_exactly(
    cluster: Cluster, replicas: list[Proc], kind: str, victim_index: int
) -> None:
    survivor, victim = replicas[0], replicas[victim_index]
    max_tokens = 120
    chat = kind == "greedy-chat"
    if chat:
        path, n = "/v1/chat/completions", 2
        body: dict = {"messages": [{"role": "user", "content": "Write a long story."}], "temperature": 0}
    else:
        path, n = "/v1/completions", 3
        body = {"prompt": PROMPT, **SEEDED}
    body.update(n=n, max_tokens=max_tokens)
    if not chat:
        body["stop"] = [_stop_ending_choice_0(survivor.url, body)]
    ref_ids, ref_texts, ref_finishes, ref_usage = _stream(
        survivor.url, path, {**body, "ignore_eos": True, "return_token_ids": True}
    )
    if chat:
        assert ref_finishes == {0: "length", 1: "length"}
    else:
        assert ref_finishes == {0: "stop", 1: "length", 2: "length"}
        assert len(ref_ids[0]) < 20  # choice 0 finishes early: the failover comes after it

    router = cluster.router("--replica", victim.url, "--replica", survivor.url, "--policy", "round_robin")
    c = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=60)
    sdk_body = {k: v for k, v in body.items() if k not in ("messages", "prompt", "stop")}
    opts = {
        **sdk_body,
        "stream": True,
        "stream_options": {"include_usage": True},
        "extra_body": {"ignore_eos": True},
    }
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    roles: dict[int, int] = {}
    stream_ids, usage = set(), None
    killer: threading.Timer | None = None
    with victim.throttle() as throttle:
        if chat:
            stream = c.chat.completions.create(model=MODEL, messages=body["messages"], **opts)
        else:
            stream = c.completions.create(model=MODEL, prompt=PROMPT, stop=body["stop"], **opts)
        for chunk in stream:
            stream_ids.add(chunk.id)
            usage = chunk.usage or usage
            for ch in chunk.choices:
                if chat:
                    texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
                    roles[ch.index] = roles.get(ch.index, 0) + (1 if ch.delta.role else 0)
                else:
                    texts[ch.index] = texts.get(ch.index, "") + ch.text
                if ch.finish_reason:
                    finishes.setdefault(ch.index, []).append(ch.finish_reason)
            started = all(texts.get(i) for i in range(n))
            if killer is None and started and (chat or 0 in finishes):
                # Every choice is under way (and choice 0 done, when it stops early): freeze the
                # victim now and kill it a moment later.
                killer = throttle.freeze_then_kill()
                assert replicas_view(router)[victim.url]["inflight"] == 1
    assert killer is not None
    killer.join()
    assert metric(router.url, "ferry:router_failovers_total") == 1
    assert texts == ref_texts  # every choice: no duplicate, no gap; the finished one not re-sent
    assert finishes == {i: [ref_finishes[i]] for i in range(n)}
    completion = sum(len(v) for v in ref_ids.values())
    assert usage.completion_tokens == completion == ref_usage["completion_tokens"]
    assert usage.prompt_tokens == ref_usage["prompt_tokens"]
    assert usage.total_tokens == usage.prompt_tokens + completion
    assert len(stream_ids) == 1
    if chat:
        assert roles == {0: 1, 1: 1}  # one role chunk per choice, none again after the failover
    assert wait_until(
        lambda: all(v["inflight"] == v["prefilling"] == 0 for v in replicas_view(router).values())
    )
