"""A disaggregated request answers exactly as one replica does: its refusals (status and OpenAI
error body, before any 200), the 503 when no decode worker can take it (with no prefill spent),
and how its first token ends it (``finish_reason``, ``stop_reason``, text, usage, token ids).

The reference is the decode worker itself, which serves a plain request whole as a mixed replica
does. One prefill and one decode worker on the session's Redis tier; a PD router over them
(``--pd-threshold 0``: every request is handed off), one whose decode worker does not exist, and a
plain router whose one replica does not exist.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from engine.tokenizer import Tokenizer
from tests.router.router_harness import Cluster, Proc, free_port, metric, replicas_view, wait_until

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
PROMPT = "def handle(request):\n    body = json.loads(request.body)\n    return"


@dataclass
class Workers:
    prefill: Proc
    decode: Proc  # also the reference: a plain request is served whole there
    router: Proc  # --prefill P --decode D
    no_decode: Proc  # --prefill P --decode <nothing listens>
    plain_dead: Proc  # --replica <nothing listens>: a router with no routable replica


@pytest.fixture(scope="module")
def pd(tiny_llama: Path, redis_server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workers]:
    redis_server.flush()
    cluster = Cluster(tiny_llama, tmp_path_factory.mktemp("pd-client-errors"))
    tier = ("--kv-tier", redis_server.url, "--num-kv-blocks", "256", "--max-num-seqs", "4")
    try:
        (prefill,) = cluster.replicas(1, "--role", "prefill", *tier)
        (decode,) = cluster.replicas(1, "--role", "decode", *tier)
        model = ("--model", str(tiny_llama), "--pd-threshold", "0")
        dead = f"http://127.0.0.1:{free_port()}"
        router = cluster.router(*model, "--prefill", prefill.url, "--decode", decode.url)
        no_decode = cluster.router(*model, "--prefill", prefill.url, "--decode", dead)
        plain_dead = cluster.router("--model", str(tiny_llama), "--replica", dead)
        for r in (router, no_decode):
            assert wait_until(lambda r=r: replicas_view(r)[prefill.url]["routable"])
        yield Workers(prefill, decode, router, no_decode, plain_dead)
    finally:
        cluster.close()


def _body(path: str, **fields) -> dict:
    prompt = {"messages": [{"role": "user", "content": PROMPT}]} if path == CHAT else {"prompt": PROMPT}
    return {**prompt, "temperature": 0, **fields}


def _status_and_body(url: str, path: str, body: dict) -> tuple[int, dict, httpx.Headers]:
    """The status and JSON body of an answer that is not a stream (a refusal)."""
    with httpx.stream("POST", url + path, json=body, timeout=60) as r:
        content = r.read()
        assert not r.headers.get("content-type", "").startswith("text/event-stream"), content
        return r.status_code, json.loads(content), r.headers


def _counts(usage: dict) -> tuple[int, int, int]:
    # (cached_tokens is the prefill worker's through PD: another replica's prefix cache)
    return usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]


def _answer(url: str, path: str, body: dict) -> dict:
    """What a client reads from a 200: text, finish_reason, stop_reason, token ids, token counts."""
    if not body.get("stream"):
        r = httpx.post(url + path, json=body, timeout=60)
        assert r.status_code == 200, r.text
        obj = r.json()
        c = obj["choices"][0]
        text = c["message"]["content"] if path == CHAT else c["text"]
        return {
            "text": text,
            "finish_reason": c["finish_reason"],
            "stop_reason": c["stop_reason"],
            "token_ids": c["token_ids"],
            "usage": _counts(obj["usage"]),
        }
    out: dict = {"text": "", "finish_reason": None, "stop_reason": None, "token_ids": [], "usage": None}
    with httpx.stream("POST", url + path, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            assert "error" not in obj, obj
            if obj.get("usage") and not obj["choices"]:
                out["usage"] = _counts(obj["usage"])
            for c in obj["choices"]:
                out["text"] += (c["delta"].get("content") or "") if path == CHAT else c["text"]
                out["token_ids"] += c.get("token_ids") or []
                if c["finish_reason"] is not None:
                    out["finish_reason"], out["stop_reason"] = c["finish_reason"], c.get("stop_reason")
    return out


def _prefills(pd: Workers) -> float:
    return metric(pd.prefill.url, "vllm:request_success_total")


# ---- finding 3: a stream's stream_options is checked although the producer never sees it ----------


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_bad_stream_options_is_the_replicas_400_without_prefill(pd: Workers, path: str) -> None:
    before = _prefills(pd)
    cases = [
        ("x", "stream_options"),
        ([1], "stream_options"),
        ({"include_usage": "x"}, "stream_options.include_usage"),
    ]
    for value, param in cases:
        body = _body(path, max_tokens=4, stream=True, stream_options=value)
        status, got, _ = _status_and_body(pd.router.url, path, body)
        ref_status, ref, _ = _status_and_body(pd.decode.url, path, body)
        assert (status, got) == (ref_status, ref) == (400, ref)
        assert (got["error"]["param"], got["error"]["code"]) == (param, "invalid_value")
        assert got["error"]["type"] == "BadRequestError"
    # Another bad field named first by the replica is the one named (the whole request is checked).
    body = _body(path, max_tokens=4, temperature="hot", stream=True, stream_options="x")
    status, got, _ = _status_and_body(pd.router.url, path, body)
    assert (status, got) == _status_and_body(pd.decode.url, path, body)[:2]
    assert got["error"]["param"] == "temperature"
    assert got["error"]["message"].endswith("(and 1 more error(s))")
    assert _prefills(pd) == before  # refused before any prefill


# ---- finding 7: the fields the hand-off rewrites are refused as a replica refuses them -------------

BAD_BUDGETS = [
    ({"max_tokens": 2000}, "max_tokens", "context_length_exceeded"),
    ({"max_tokens": -1}, "max_tokens", "invalid_value"),
    ({"max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"max_tokens": 5, "min_tokens": 10}, "min_tokens", "invalid_value"),
    ({"max_completion_tokens": "x"}, "max_completion_tokens", "invalid_value"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "invalid_value"),
    ({"max_completion_tokens": 5000}, "max_tokens", "context_length_exceeded"),
    ({"max_tokens": 4, "stream": "yes"}, "stream", "invalid_value"),
    ({"max_tokens": 4, "stream": 1}, "stream", "invalid_value"),
    ({"max_tokens": 4, "return_token_ids": "x"}, "return_token_ids", "invalid_value"),
]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_bad_budget_stream_is_the_replicas_400_before_any_200(pd: Workers, path: str) -> None:
    for fields, param, code in BAD_BUDGETS:
        body = _body(path, **{"stream": True, **fields})
        status, got, _ = _status_and_body(pd.router.url, path, body)
        ref_status, ref, _ = _status_and_body(pd.decode.url, path, body)
        assert (status, got) == (ref_status, ref), fields
        assert status == 400 and (got["error"]["param"], got["error"]["code"]) == (param, code), got
    # Not streamed: the same answers (the prefill worker's, for the budget it was sent as is).
    for fields, param, code in BAD_BUDGETS[:3]:
        body = _body(path, **fields)
        status, got, _ = _status_and_body(pd.router.url, path, body)
        assert (status, got) == _status_and_body(pd.decode.url, path, body)[:2]
        assert (got["error"]["param"], got["error"]["code"]) == (param, code)
    # A valid min_tokens above one (checked by the decode worker before the stream's 200) is
    # still handed off, and answered as a replica answers it.
    disaggregated = {"path": "disaggregated"}
    before = metric(pd.router.url, "ferry:router_pd_requests_total", disaggregated)
    body = _body(path, max_tokens=6, min_tokens=6, stream=True, return_token_ids=True)
    body["stream_options"] = {"include_usage": True}
    got = _answer(pd.router.url, path, body)
    assert got == _answer(pd.decode.url, path, body)
    assert len(got["token_ids"]) == got["usage"][1] == 6
    assert metric(pd.router.url, "ferry:router_pd_requests_total", disaggregated) == before + 1


# ---- finding 8: no routable decode worker: a router's 503, no prefill ------------------------------


def test_no_routable_decode_worker_answers_503_without_prefill(pd: Workers) -> None:
    before = _prefills(pd)
    expected = {
        "error": {
            "message": "no healthy replica available (1 registered, none routable now)",
            "type": "ServiceUnavailableError",
            "param": None,
            "code": "service_unavailable",
        }
    }
    for stream in (False, True):
        body = _body(CHAT, max_tokens=4, stream=stream)
        status, got, headers = _status_and_body(pd.no_decode.url, CHAT, body)
        assert (status, got, headers["retry-after"]) == (503, expected, "1")
        # what a router whose one replica is down answers
        assert (status, got) == _status_and_body(pd.plain_dead.url, CHAT, body)[:2]
    assert _prefills(pd) == before
    reason = {"reason": "no_decode_worker"}
    assert metric(pd.no_decode.url, "ferry:router_pd_local_prefill_total", reason) == 2
    assert metric(pd.no_decode.url, "ferry:router_pd_requests_total", {"path": "disaggregated"}) == 0


# ---- finding 10: the first token ends the request: stop_reason and where it stops ------------------


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_stop_string_in_the_first_token_keeps_stop_reason(pd: Workers, path: str) -> None:
    # Token 150 (a lone byte, not a character yet) is where greedy chat answers start here.
    common = {"logit_bias": {"150": -100}, "return_token_ids": True}
    first = _answer(pd.decode.url, path, _body(path, max_tokens=1, **common))["text"]
    assert first.strip() and "\ufffd" not in first, first
    decode_before = metric(pd.decode.url, "vllm:request_success_total")
    for stream in (False, True):
        body = _body(path, max_tokens=8, stop=[first], stream=stream, **common)
        if stream:
            body["stream_options"] = {"include_usage": True}
        got = _answer(pd.router.url, path, body)
        assert got == _answer(pd.decode.url, path, body)
        assert (got["finish_reason"], got["stop_reason"]) == ("stop", first)
        assert got["usage"][1] == 1 and len(got["token_ids"]) == 1
    # the prefill worker's answer was the whole answer: the decode worker served only the references
    assert metric(pd.decode.url, "vllm:request_success_total") == decode_before + 2


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_unfinished_character_is_not_a_stop_at_the_first_token(
    pd: Workers, path: str, tiny_llama: Path
) -> None:
    """Only a lead byte of a three-byte character may be drawn: a replica holds each back as an
    unfinished character, so the U+FFFD stop matches when the request ends on its budget (three
    tokens), not at the producer's one-token end."""
    lead = Tokenizer.from_dir(tiny_llama).backend.token_to_id("â")  # byte 0xE2
    for stream in (False, True):
        body = _body(
            path,
            max_tokens=3,
            allowed_token_ids=[lead],
            stop=["\ufffd"],
            return_token_ids=True,
            stream=stream,
        )
        if stream:
            body["stream_options"] = {"include_usage": True}
        got = _answer(pd.router.url, path, body)
        assert got == _answer(pd.decode.url, path, body)
        assert (got["finish_reason"], got["stop_reason"], got["text"]) == ("stop", "\ufffd", "")
        assert got["token_ids"] == [lead] * 3 and got["usage"][1] == 3


def test_chat_answer_opening_with_a_lone_byte_stops_where_a_replica_does(pd: Workers) -> None:
    """Greedy chat answers here open with token 150, a byte a replica shows (as U+FFFD) only with
    the next token: a U+FFFD stop ends them at the second token, not at the producer's first."""
    for stream in (False, True):
        body = _body(CHAT, max_tokens=8, stop=["\ufffd"], return_token_ids=True, stream=stream)
        if stream:
            body["stream_options"] = {"include_usage": True}
        got = _answer(pd.router.url, CHAT, body)
        assert got == _answer(pd.decode.url, CHAT, body)
        assert (got["finish_reason"], got["stop_reason"], got["text"]) == ("stop", "\ufffd", "")
        assert got["token_ids"][0] == 150 and len(got["token_ids"]) == got["usage"][1] == 2


# ---- a request for an unknown model that is also invalid: the replica's 400 first ------------------

# Fields the producer request moves or drops (the budget, a stream's stream_options), invalid as a
# replica's schema sees them: a replica names them (400) before it looks at ``model`` (404).
MOVED_AND_INVALID = [
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": "x"}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"stream": True, "stream_options": "x"}, "stream_options"),
    ({"kv_transfer": {"role": "bogus"}}, "kv_transfer.role"),
]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_unknown_model_with_an_invalid_field_is_the_replicas_answer(pd: Workers, path: str) -> None:
    before = _prefills(pd)
    for stream in (False, True):
        for fields, param in MOVED_AND_INVALID:
            body = _body(path, **{"max_tokens": 4, "stream": stream, **fields, "model": "no-such-model"})
            status, got, _ = _status_and_body(pd.router.url, path, body)
            assert (status, got) == _status_and_body(pd.decode.url, path, body)[:2], fields
            assert (status, got["error"]["param"], got["error"]["type"]) == (400, param, "BadRequestError")
    assert _prefills(pd) == before  # refused by the router, as a replica would, before any prefill
    # Valid fields, unknown model: the prefill worker's 404 (a replica's), whatever the budget says.
    for stream in (False, True):
        body = _body(path, max_tokens=2000, stream=stream, model="no-such-model")
        status, got, _ = _status_and_body(pd.router.url, path, body)
        assert (status, got) == _status_and_body(pd.decode.url, path, body)[:2]
        assert (status, got["error"]["code"]) == (404, "model_not_found")


# ---- the client's own resume and kv_transfer: honoured as a replica honours them -------------------


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_client_resume_is_served_as_a_replica_serves_it(pd: Workers, path: str) -> None:
    """``resume`` is ferry's field (DESIGN.md: a router may stand in front of another router, and a
    client cannot tell a router from a replica): the PD router serves it whole, as a replica does,
    instead of sending the producer a resume it refuses."""
    start = _answer(pd.decode.url, path, _body(path, max_tokens=3, return_token_ids=True))["token_ids"]
    reason = {"reason": "resume"}
    before = metric(pd.router.url, "ferry:router_pd_local_prefill_total", reason)
    for stream in (False, True):
        body = _body(path, max_tokens=8, return_token_ids=True, stream=stream, resume={"token_ids": start})
        if stream:
            body["stream_options"] = {"include_usage": True}
        got = _answer(pd.router.url, path, body)
        assert got == _answer(pd.decode.url, path, body)
        assert len(got["token_ids"]) == got["usage"][1] == 5  # the resumed tokens count in max_tokens
    assert metric(pd.router.url, "ferry:router_pd_local_prefill_total", reason) == before + 2
    # A consumer kv_transfer naming another prompt's blocks: the replica's 400, not a hand-off.
    bad = {"role": "consumer", "block_hashes": ["0" * 32]}
    body = _body(path, max_tokens=4, stream=True, kv_transfer=bad)
    status, got, _ = _status_and_body(pd.router.url, path, body)
    assert (status, got) == _status_and_body(pd.decode.url, path, body)[:2]
    assert (status, got["error"]["code"]) == (400, "kv_transfer_mismatch")
