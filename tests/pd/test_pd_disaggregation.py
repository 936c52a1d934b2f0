"""Prefill/decode disaggregation end to end: `ferry router` over prefill and decode workers.

Exactness: for 16 prompts, greedy and seeded, completions and chat, streamed and not, the tokens
a client gets through the PD router equal a colocated replica's and the offline ``LLM``'s.
Work split: the decode workers load every full prompt block from the tier (tier hit counters)
and prefill workers hold no KV block once they answered. Failures (a prefill worker too slow or
killed, the tier gone, a decode worker killed mid-stream) end with every request complete and
exact.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import httpx

from engine import LLM, SamplingParams
from engine.tokenizer import Tokenizer
from tests.pd.pd_cluster import PD_THRESHOLD, PDCluster
from tests.router.router_harness import metric, wait_until

MAX_TOKENS = 8
SOURCE = Path(__file__).read_text()


def _text(i: int, words: int) -> str:
    start = (i * 97) % (len(SOURCE) - 4000)
    return " ".join(SOURCE[start : start + 4000].split()[:words])


def _case(i: int, seeded: bool) -> tuple[str, dict]:
    """Request ``i``: even ones completions, odd ones chat; the stream flag alternates by pairs."""
    sampling = {"temperature": 0.9, "seed": 1000 + i} if seeded else {"temperature": 0}
    common = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "return_token_ids": True, **sampling}
    common["stream"] = (i // 2) % 2 == 1
    if common["stream"]:
        common["stream_options"] = {"include_usage": True}
    words = 12 + 3 * i
    if i % 2 == 0:
        return "/v1/completions", {"prompt": _text(i, words), **common}
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": _text(i, words)}], **common}


def _call(base: str, path: str, body: dict, on_chunk=None) -> tuple[list[int], str, dict]:
    """(token ids, text, usage) of one request; ``on_chunk(n)`` after each streamed content chunk."""
    chat = path.endswith("chat/completions")
    if not body.get("stream"):
        r = httpx.post(base + path, json=body, timeout=120)
        assert r.status_code == 200, r.text
        obj = r.json()
        choice = obj["choices"][0]
        return choice["token_ids"], choice["message"]["content"] if chat else choice["text"], obj["usage"]
    ids: list[int] = []
    text, usage, ids_seen = "", None, 0
    with httpx.stream("POST", base + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            assert "error" not in obj, obj
            if obj.get("usage") and not obj.get("choices"):
                usage = obj["usage"]
            for choice in obj.get("choices", []):
                ids += choice.get("token_ids") or []
                text += (choice.get("delta") or {}).get("content") or "" if chat else choice.get("text", "")
            if on_chunk is not None and len(ids) > ids_seen:
                ids_seen = len(ids)
                on_chunk(len(ids))
    return ids, text, usage


def _prompt_ids(tokenizer: Tokenizer, path: str, body: dict) -> list[int]:
    if path.endswith("chat/completions"):
        return tokenizer.encode_chat(body["messages"], add_generation_prompt=True)
    return tokenizer.encode(body["prompt"])


def test_pd_equals_colocated_equals_offline(pd: PDCluster, tiny_llama: Path, tokenizer: Tokenizer) -> None:
    cases = [_case(i, seeded) for seeded in (False, True) for i in range(16)]
    before = metric(pd.router.url, "ferry:router_pd_requests_total", {"path": "disaggregated"})
    prompts, params = [], []
    through_pd, colocated = [], []
    for path, body in cases:
        ids = _prompt_ids(tokenizer, path, body)
        assert len(ids) >= PD_THRESHOLD + 16
        prompts.append(ids)
        params.append(
            SamplingParams(
                max_tokens=MAX_TOKENS,
                ignore_eos=True,
                temperature=body["temperature"],
                seed=body.get("seed"),
            )
        )
        got = _call(pd.router.url, path, body)
        through_pd.append(got)
        colocated.append(_call(pd.mixed.url, path, body))
        usage = got[2]
        assert usage["prompt_tokens"] == len(ids)
        assert usage["completion_tokens"] == MAX_TOKENS and usage["total_tokens"] == len(ids) + MAX_TOKENS
    offline = LLM(str(tiny_llama), num_kv_blocks=256, num_threads=1, deterministic=True).generate(
        prompts, params
    )
    for (ids, text, _), (ref_ids, ref_text, _), out in zip(through_pd, colocated, offline, strict=True):
        assert ids == ref_ids == list(out.outputs[0].token_ids)
        assert text == ref_text
    after = metric(pd.router.url, "ferry:router_pd_requests_total", {"path": "disaggregated"})
    assert after - before == len(cases)


def test_structured_outputs_hold_across_the_hand_off(pd: PDCluster) -> None:
    """The prefill worker draws the first token under the constraint, the decode worker's grammar
    takes it as a resumed token and continues: the text follows the regex and equals a colocated
    replica's, greedy and seeded."""
    regex = r"[a-f]{3}-[0-9]{4}"
    before = metric(pd.router.url, "ferry:router_pd_requests_total", {"path": "disaggregated"})
    for i, sampling in enumerate(({"temperature": 0}, {"temperature": 1.0, "seed": 7})):
        for stream in (False, True):
            body = {
                "prompt": f"structured {i} {stream}: " + _text(60 + i, 60),  # new to every decode worker
                "max_tokens": 20,
                "return_token_ids": True,
                "stream": stream,
                "structured_outputs": {"regex": regex},
                **sampling,
            }
            ids, text, _ = _call(pd.router.url, "/v1/completions", body)
            assert re.fullmatch(regex, text), text
            assert (ids, text) == _call(pd.mixed.url, "/v1/completions", body)[:2]
    after = metric(pd.router.url, "ferry:router_pd_requests_total", {"path": "disaggregated"})
    assert after - before == 4


def _tier_hits(pd: PDCluster) -> float:
    return sum(metric(d.url, "ferry:kv_tier_hits_total") for d in pd.decode)


def _decode_idle(pd: PDCluster) -> None:
    """Wait until no decode worker runs or queues a request: an earlier test's (a stream its client
    left, still being aborted on a loaded machine) would otherwise share the worker's KV cache and
    its running count with the test's own."""
    assert wait_until(
        lambda: all(
            metric(d.url, "vllm:num_requests_running") == 0
            and metric(d.url, "vllm:num_requests_waiting") == 0
            for d in pd.decode
        )
    ), "a decode worker never went idle"


def test_decode_loads_every_prompt_block_and_prefill_holds_none(pd: PDCluster, tokenizer: Tokenizer) -> None:
    _decode_idle(pd)
    expected, before = 0, _tier_hits(pd)
    for i in range(4):
        body = {"prompt": f"fresh prompt {i}: " + _text(40 + i, 50), "max_tokens": 4, "temperature": 0}
        expected += len(tokenizer.encode(body["prompt"])) // 16
        ids, _, usage = _call(pd.router.url, "/v1/completions", {**body, "return_token_ids": True})
        assert (
            len(ids) == 4 and usage["prompt_tokens_details"]["cached_tokens"] == 0
        )  # new to the prefill worker
    # The decode workers computed none of the prompt blocks the prefill workers wrote: all loaded.
    assert _tier_hits(pd) - before == expected
    for p in pd.prefill:
        assert metric(p.url, "vllm:kv_cache_usage_perc") == 0.0  # nothing held for a decode worker
        assert metric(p.url, "vllm:num_requests_running") == 0.0


def test_short_prompts_and_n_prefill_on_decode(pd: PDCluster) -> None:
    before = metric(pd.router.url, "ferry:router_pd_requests_total", {"path": "local_prefill"})
    short = {"prompt": "def f(x):", "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    assert (
        _call(pd.router.url, "/v1/completions", short)[0] == _call(pd.mixed.url, "/v1/completions", short)[0]
    )
    two = {"prompt": _text(3, 40), "max_tokens": 5, "temperature": 0.8, "seed": 7, "n": 2}
    got = httpx.post(pd.router.url + "/v1/completions", json=two, timeout=60).json()
    ref = httpx.post(pd.mixed.url + "/v1/completions", json=two, timeout=60).json()
    assert [c["text"] for c in got["choices"]] == [c["text"] for c in ref["choices"]]
    # A beam search (n = 1 too) runs whole on one worker: each of its steps is a request of its own.
    beams = {
        "prompt": _text(4, 40),
        "max_tokens": 5,
        "n": 1,
        "use_beam_search": True,
        "return_token_ids": True,
    }
    got = httpx.post(pd.router.url + "/v1/completions", json=beams, timeout=60).json()
    ref = httpx.post(pd.mixed.url + "/v1/completions", json=beams, timeout=60).json()
    assert [c["token_ids"] for c in got["choices"]] == [c["token_ids"] for c in ref["choices"]]
    assert metric(pd.router.url, "ferry:router_pd_local_prefill_total", {"reason": "short_prompt"}) >= 1
    assert metric(pd.router.url, "ferry:router_pd_local_prefill_total", {"reason": "n"}) >= 1
    assert metric(pd.router.url, "ferry:router_pd_local_prefill_total", {"reason": "beam_search"}) == 1
    assert metric(pd.router.url, "ferry:router_pd_requests_total", {"path": "local_prefill"}) - before == 3


def test_mixed_replicas_serve_what_is_not_disaggregated(pd: PDCluster) -> None:
    """With a mixed replica beside the PD pools, short prompts and n > 1 run whole there (never
    on the decode worker); long prompts are still disaggregated."""
    url = pd.mixed_router.url

    def paths() -> dict[str, float]:
        return {
            p: metric(url, "ferry:router_pd_requests_total", {"path": p})
            for p in ("mixed", "local_prefill", "disaggregated")
        }

    def decode_requests() -> float:
        return metric(pd.decode[0].url, "vllm:request_success_total")

    before, decode_before = paths(), decode_requests()
    short = {"prompt": "def f(x):", "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    assert _call(url, "/v1/completions", short)[0] == _call(pd.mixed.url, "/v1/completions", short)[0]
    two = {"prompt": _text(3, 40), "max_tokens": 5, "temperature": 0.8, "seed": 7, "n": 2}
    got = httpx.post(url + "/v1/completions", json=two, timeout=60).json()
    assert len(got["choices"]) == 2
    after = paths()
    assert after["mixed"] - before["mixed"] == 2
    assert after["local_prefill"] == before["local_prefill"]
    assert decode_requests() == decode_before  # the decode worker never saw them
    long = {"prompt": _text(5, 60), "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    assert _call(url, "/v1/completions", long)[0] == _call(pd.mixed.url, "/v1/completions", long)[0]
    assert paths()["disaggregated"] - after["disaggregated"] == 1
    assert decode_requests() == decode_before + 1


def test_first_token_ends_the_request_on_the_prefill_worker(pd: PDCluster) -> None:
    prompt = _text(9, 40)
    first = _call(
        pd.mixed.url,
        "/v1/completions",
        {"prompt": prompt, "max_tokens": 1, "temperature": 0, "return_token_ids": True},
    )
    stop = {
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0,
        "stop_token_ids": first[0],
        "return_token_ids": True,
    }
    decode_requests = sum(metric(d.url, "vllm:request_success_total") for d in pd.decode)
    for stream in (False, True):
        body = {**stop, "stream": True, "stream_options": {"include_usage": True}} if stream else stop
        got, ref = _call(pd.router.url, "/v1/completions", body), _call(pd.mixed.url, "/v1/completions", body)
        assert got[:2] == ref[:2]
        assert (got[2]["prompt_tokens"], got[2]["completion_tokens"]) == (ref[2]["prompt_tokens"], 1)
    # the prefill worker's answer was the whole answer: no decode worker was asked
    assert sum(metric(d.url, "vllm:request_success_total") for d in pd.decode) == decode_requests


def test_slow_prefill_worker_falls_back_to_local_prefill(pd: PDCluster) -> None:
    # Prompts no other test sends: a decode worker that cached one (another test's request through
    # the main router) would make it a short prompt for this router, which follows its KV events.
    for i in range(40, 43):
        path, body = _case(i, seeded=True)
        assert _call(pd.slow_router.url, path, body)[0] == _call(pd.mixed.url, path, body)[0]
    failed = metric(pd.slow_router.url, "ferry:router_pd_local_prefill_total", {"reason": "prefill_failed"})
    reasons = [line for line in httpx.get(pd.slow_router.url + "/metrics").text.splitlines() if "pd_" in line]
    assert failed == 3, reasons
    assert metric(pd.slow_router.url, "ferry:router_pd_requests_total", {"path": "disaggregated"}) == 0


def test_tier_gone_decode_recomputes(pd: PDCluster, redis_server) -> None:
    redis_server.stop()
    try:
        hits = _tier_hits(pd)
        for i in range(2):
            path, body = _case(20 + i, seeded=False)
            body = {**body, "stream": True, "stream_options": {"include_usage": True}}
            ids, text, usage = _call(pd.router.url, path, body)
            ref_ids, ref_text, _ = _call(pd.mixed.url, path, body)
            assert (ids, text) == (ref_ids, ref_text) and usage["completion_tokens"] == MAX_TOKENS
        assert _tier_hits(pd) == hits  # nothing could be loaded: the decode worker computed it all
    finally:
        redis_server.start()


def test_decode_worker_killed_mid_stream_fails_over(pd: PDCluster) -> None:
    body = {
        "prompt": _text(5, 40),
        "max_tokens": 800,  # still streaming at its third chunk, even after a loaded machine's stall
        "ignore_eos": True,
        "temperature": 0.7,
        "seed": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    _decode_idle(pd)  # the worker found running a request is the one serving this stream
    failovers = metric(pd.router.url, "ferry:router_failovers_total")
    killed: list[str] = []

    def kill_serving_decode(n: int) -> None:
        if killed or n < 3:
            return
        for d in pd.decode:
            if metric(d.url, "vllm:num_requests_running") >= 1:
                killed.append(d.url)
                d.kill9()
                return

    ids, text, usage = _call(pd.router.url, "/v1/completions", body, on_chunk=kill_serving_decode)
    ref_ids, ref_text, _ = _call(pd.mixed.url, "/v1/completions", body)
    assert killed, "the stream finished before a decode worker could be killed"
    assert ids == ref_ids and text == ref_text
    assert usage["completion_tokens"] == 800
    assert metric(pd.router.url, "ferry:router_failovers_total") - failovers == 1


def test_prefill_workers_killed_requests_still_complete(pd: PDCluster) -> None:
    pd.prefill[1].kill9()
    results: list[bool] = []

    def one(i: int) -> None:
        path, body = _case(i, seeded=True)
        results.append(_call(pd.router.url, path, body)[0] == _call(pd.mixed.url, path, body)[0])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == [True] * 4
    local_before = metric(pd.router.url, "ferry:router_pd_requests_total", {"path": "local_prefill"})
    pd.prefill[0].kill9()
    for i in range(2):
        path, body = _case(i, seeded=False)
        assert _call(pd.router.url, path, body)[0] == _call(pd.mixed.url, path, body)[0]
    assert (
        metric(pd.router.url, "ferry:router_pd_requests_total", {"path": "local_prefill"}) - local_before == 2
    )
