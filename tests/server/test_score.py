"""vLLM's scoring endpoints (``/score``, ``/rerank`` and their aliases) on the session's replica
(tiny Llama, embeddings by last-token pooling): a score is the dot product of the two texts'
``/v1/embeddings`` vectors; a rerank is those scores sorted; usage is the tokens of each distinct
text, once; pairing rules; each client mistake a 400 naming its field; the API key, overload
(429) and a gone client on a guarded replica; the same answers through ``ferry router``."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import REPO, free_port, metric_value

QUERY = "def parse_args(argv):"
DOCS = ["import argparse\nparser = argparse.ArgumentParser()", "x = 1", "def parse(argv):", "print(x)"]
LONG = " ".join(str(i) for i in range(1500))  # more than the tiny model's 1024 positions


def _post(url: str, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60, **kw)


def _embed(url: str, texts: list[str], **extra) -> list[list[float]]:
    r = _post(url, "/v1/embeddings", {"input": texts, "encoding_format": "float", **extra})
    assert r.status_code == 200, r.text
    return [d["embedding"] for d in r.json()["data"]]


def _dot(a: list[float], b: list[float]) -> float:
    return math.fsum(x * y for x, y in zip(a, b, strict=True))


def _tokens(url: str, texts: list[str]) -> int:
    return sum(len(_post(url, "/tokenize", {"prompt": t}).json()["tokens"]) for t in texts)


def _scores(r: httpx.Response) -> list[float]:
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["index"] for d in data] == list(range(len(data)))
    return [d["score"] for d in data]


def _close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and all(abs(g - w) < 1e-6 for g, w in zip(got, want, strict=True))


def test_score_is_the_dot_product_of_the_embeddings(server) -> None:
    vectors = _embed(server.url, [QUERY, *DOCS])
    want = [_dot(vectors[0], v) for v in vectors[1:]]
    assert len(set(want)) == len(want)  # distinct scores: the order below means something
    text = httpx.get(server.url + "/metrics").text
    before = metric_value(text, "vllm:request_success_total", finished_reason="stop") or 0.0
    r = _post(server.url, "/score", {"model": server.model_name, "text_1": QUERY, "text_2": DOCS})
    assert _close(_scores(r), want)
    body = r.json()
    assert body["id"].startswith("score-") and body["object"] == "list" and body["model"] == server.model_name
    assert isinstance(body["created"], int) and {d["object"] for d in body["data"]} == {"score"}
    tokens = _tokens(server.url, [QUERY, *DOCS])  # the query is embedded (and counted) once
    assert body["usage"] == {
        "prompt_tokens": tokens,
        "total_tokens": tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
    }  # vLLM's UsageInfo (a rerank's is its RerankUsage: the first two)
    # One pooling engine request per distinct text, counted as embeddings' are.
    after = metric_value(
        httpx.get(server.url + "/metrics").text, "vllm:request_success_total", finished_reason="stop"
    )
    assert after == before + 1 + len(DOCS)


def test_pairing_rules_and_every_spelling(server) -> None:
    vectors = dict(zip([QUERY, *DOCS], _embed(server.url, [QUERY, *DOCS]), strict=True))
    firsts = [QUERY, DOCS[0], DOCS[1]]
    pairs = list(zip(firsts, DOCS[1:], strict=True))
    want = [_dot(vectors[a], vectors[b]) for a, b in pairs]
    for first, second in (
        ("text_1", "text_2"),
        ("data_1", "data_2"),
        ("queries", "documents"),
        ("queries", "items"),
    ):
        for path in ("/score", "/v1/score"):
            r = _post(server.url, path, {first: firsts, second: DOCS[1:]})  # N:N, in order
            assert _close(_scores(r), want), (first, path)
    one = _post(server.url, "/score", {"text_1": QUERY, "text_2": DOCS[2]})  # 1:1, plain strings
    assert _close(_scores(one), [_dot(vectors[QUERY], vectors[DOCS[2]])])
    listed = _post(server.url, "/score", {"text_1": [QUERY], "text_2": DOCS})  # a list of one is 1:N
    assert _close(_scores(listed), [_dot(vectors[QUERY], vectors[d]) for d in DOCS])
    # DOCS[0] and DOCS[1] stand on both sides: each distinct text is embedded and counted once.
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == _tokens(server.url, [QUERY, *DOCS])
    same = _post(server.url, "/score", {"text_1": "x = 1", "text_2": "x = 1"})
    assert _close(_scores(same), [1.0]) and same.json()["usage"]["prompt_tokens"] == _tokens(
        server.url, ["x = 1"]
    )


def test_rerank_sorts_by_score_keeps_top_n_and_documents(server) -> None:
    vectors = _embed(server.url, [QUERY, *DOCS])
    scores = [_dot(vectors[0], v) for v in vectors[1:]]
    order = sorted(range(len(DOCS)), key=lambda i: -scores[i])
    assert (
        min(scores[a] - scores[b] for a, b in zip(order, order[1:], strict=False)) > 1e-4
    )  # an order to keep
    tokens = _tokens(server.url, [QUERY, *DOCS])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = _post(server.url, path, {"model": server.model_name, "query": QUERY, "documents": DOCS})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["id"].startswith("rerank-") and body["model"] == server.model_name
        assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
        assert [x["index"] for x in body["results"]] == order
        assert [x["document"] for x in body["results"]] == [{"text": DOCS[i]} for i in order]
        assert _close([x["relevance_score"] for x in body["results"]], [scores[i] for i in order])
    top = _post(
        server.url, "/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2, "return_documents": False}
    )
    assert top.status_code == 200, top.text
    assert [sorted(x) for x in top.json()["results"]] == [["index", "relevance_score"]] * 2
    assert [x["index"] for x in top.json()["results"]] == order[:2]
    every = _post(server.url, "/rerank", {"query": QUERY, "documents": DOCS, "top_n": 99})
    assert [x["index"] for x in every.json()["results"]] == order


def test_truncate_prompt_tokens_keeps_the_last_tokens(server) -> None:
    short = _embed(server.url, [QUERY, DOCS[0]], truncate_prompt_tokens=3)
    r = _post(server.url, "/score", {"text_1": QUERY, "text_2": DOCS[0], "truncate_prompt_tokens": 3})
    assert _close(_scores(r), [_dot(*short)]) and r.json()["usage"]["prompt_tokens"] == 6
    # -1: each text cut to the model's context (1024 tokens), which alone would be too long.
    full = _embed(server.url, [LONG], truncate_prompt_tokens=1024) + _embed(server.url, ["x = 1"])
    r = _post(server.url, "/rerank", {"query": LONG, "documents": ["x = 1"], "truncate_prompt_tokens": -1})
    assert r.status_code == 200, r.text
    assert _close([r.json()["results"][0]["relevance_score"]], [_dot(*full)])
    assert r.json()["usage"]["total_tokens"] == 1024 + _tokens(server.url, ["x = 1"])


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        ("/score", {"text_1": [], "text_2": "x"}, "text_1", "must not be empty"),
        ("/score", {"text_1": "x", "text_2": []}, "text_2", "must not be empty"),
        ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2", "2 texts and text_2 has 3"),
        ("/score", {"text_1": ["a", "b"], "text_2": "c"}, "text_2", "as many of each"),
        ("/v1/score", {"queries": ["a", "b"], "documents": ["c"]}, "documents", "queries has 2"),
        ("/score", {"text_1": "x", "text_2": ["ok", ""]}, "text_2", "empty strings"),
        ("/score", {"text_1": "", "text_2": "ok"}, "text_1", "empty string"),
        ("/score", {"text_1": "x"}, "text_2", "required with text_1"),
        ("/score", {"documents": "x"}, "queries", "required with documents"),
        ("/score", {}, "text_1", "is required"),
        ("/score", {"text_1": "a", "text_2": "b", "queries": "c", "documents": "d"}, "queries", "one pair"),
        ("/score", {"queries": "a", "text_2": "b"}, "text_2", "pairs with text_1"),
        ("/score", {"text_1": 5, "text_2": "b"}, "text_1", ""),
        ("/score", {"text_1": [1, 2], "text_2": "b"}, "text_1", ""),
        (
            "/score",
            {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 0},
            "truncate_prompt_tokens",
            "-1",
        ),
        (
            "/score",
            {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": -2},
            "truncate_prompt_tokens",
            "",
        ),
        ("/score", {"text_1": "a", "text_2": ["b"] * 2049}, "text_2", "at most 2048"),
        ("/score", {"text_1": LONG, "text_2": "b"}, "text_1", "maximum context length is 1024 tokens"),
        ("/rerank", {"query": "", "documents": ["a"]}, "query", "empty string"),
        ("/rerank", {"query": "q", "documents": []}, "documents", "must not be empty"),
        ("/v2/rerank", {"query": "q", "documents": ["a", ""]}, "documents", "empty strings"),
        ("/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n", ""),
        ("/rerank", {"query": "q", "documents": ["a"], "return_documents": "no"}, "return_documents", ""),
        ("/rerank", {"documents": ["a"]}, "query", ""),
        ("/rerank", {"query": ["a"], "documents": ["a"]}, "query", ""),
        ("/v1/rerank", {"query": "q", "documents": [{"text": "a"}]}, "documents", ""),
        ("/rerank", {"query": "q", "documents": ["a", LONG]}, "documents", "maximum context length"),
    ],
)
def test_client_mistakes_are_400s_naming_the_field(
    server, path: str, body: dict, param: str, words: str
) -> None:
    r = _post(server.url, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "BadRequestError"
    assert param in (err["param"] or "") and words in err["message"], err


def test_unknown_model_is_404_and_the_replica_stays_idle(server) -> None:
    for path, body in (
        ("/score", {"text_1": "a", "text_2": "b"}),
        ("/rerank", {"query": "a", "documents": ["b"]}),
    ):
        r = _post(server.url, path, {**body, "model": "nope"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    text = httpx.get(server.url + "/metrics").text
    assert metric_value(text, "vllm:num_requests_running") == 0.0
    assert metric_value(text, "vllm:kv_cache_usage_perc") == 0.0


_texts = st.text(max_size=12) | st.lists(st.text(max_size=8), max_size=3)
_junk = st.none() | st.integers() | st.floats(allow_nan=False) | st.lists(st.integers(), max_size=2)
_score_bodies = st.dictionaries(
    st.sampled_from(["text_1", "text_2", "queries", "documents", "items", "data_1", "data_2"]),
    _texts | _junk,
    max_size=3,
).map(lambda d: {**d, "truncate_prompt_tokens": 2} if len(d) == 2 else d)
_rerank_bodies = st.fixed_dictionaries(
    {"query": st.text(max_size=12) | _junk, "documents": _texts | _junk},
    optional={"top_n": st.integers(-1, 5) | _junk, "return_documents": st.booleans() | _junk},
)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(
    path=st.sampled_from(["/score", "/rerank"]), score=_score_bodies | _junk, rerank=_rerank_bodies | _junk
)
def test_fuzz_never_5xx(server, path: str, score: object, rerank: object) -> None:
    body = score if path == "/score" else rerank
    r = httpx.post(server.url + path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


# -- a replica with an API key, one running slot and a queue of 2 --------------------------------

AUTH = {"Authorization": "Bearer sekrit"}


@pytest.fixture(scope="module")
def guarded(tiny_llama: Path, serve_logs: Path, server_process) -> Iterator:
    flags = ["--api-key", "sekrit", "--max-num-seqs", "1", "--max-queued-requests", "2"]
    srv = server_process(tiny_llama, [*flags, "--num-kv-blocks", "256"], serve_logs).start()
    yield srv
    srv.stop()


def test_the_api_key_guards_every_scoring_route(guarded) -> None:
    bodies = {"score": {"text_1": "a", "text_2": "b"}, "rerank": {"query": "a", "documents": ["b"]}}
    for path in ("/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank"):
        body = bodies["score" if "score" in path else "rerank"]
        r = _post(guarded.url, path, body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
        assert _post(guarded.url, path, body, headers=AUTH).status_code == 200, path


async def test_overload_is_429_and_a_gone_client_is_aborted(guarded, scrape) -> None:
    name = guarded.model_name

    async def until(metric: str, value: float, **labels: str) -> None:
        deadline = time.monotonic() + 60  # a hang guard only
        while (scrape(guarded.url, metric, model_name=name, **labels) or 0.0) != value:
            assert time.monotonic() < deadline, f"{metric} never reached {value}"
            await asyncio.sleep(0.01)

    # Two generations of ~1 s each hold the one running slot in turn, so the texts below wait
    # behind them for at least as long as the checks take.
    long = {"prompt": "x", "max_tokens": 1000, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=60, headers=AUTH) as client:
        holders = [asyncio.ensure_future(client.post(guarded.url + "/v1/completions", json=long))]
        await until("vllm:num_requests_running", 1)
        holders.append(asyncio.ensure_future(client.post(guarded.url + "/v1/completions", json=long)))
        await until("vllm:num_requests_waiting", 1)
        scoring = asyncio.ensure_future(
            client.post(guarded.url + "/score", json={"text_1": "a", "text_2": "b"})
        )
        await until("vllm:num_requests_waiting", 3)  # the queue (2) is full
        r = await client.post(guarded.url + "/rerank", json={"query": "a", "documents": ["b"]})
        assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        success = "vllm:request_success_total"
        before = scrape(guarded.url, success, model_name=name, finished_reason="abort") or 0.0
        scoring.cancel()  # the client leaves: both texts' engine requests are aborted at once
        with pytest.raises(asyncio.CancelledError):
            await scoring
        await until(success, before + 2, finished_reason="abort")
        await until("vllm:num_requests_waiting", 1)  # the second generation still waits
        for holder in holders:
            holder.cancel()
        await asyncio.gather(*holders, return_exceptions=True)
        await until("vllm:kv_cache_usage_perc", 0)
        r = await client.post(guarded.url + "/score", json={"text_1": "a", "text_2": "b"})
        assert r.status_code == 200, r.text


# -- through the router -------------------------------------------------------------------------


def _view(body: dict) -> tuple[dict, list[float]]:
    """An answer without its id and time, and its scores apart (compared to 1e-6: a prefix-cache
    hit's last state is computed over the cached KV)."""
    key = "data" if "data" in body else "results"
    scores = [x.pop("score") if "score" in x else x.pop("relevance_score") for x in body[key]]
    return {k: v for k, v in body.items() if k not in ("id", "created")}, scores


def test_through_the_router(server, tmp_path: Path) -> None:
    """Relayed like /tokenize: the router's API key, X-Request-Id kept, a dead replica skipped."""
    port, dead = free_port(), free_port()
    cmd = [sys.executable, "-m", "ferry", "router", "--port", str(port), "--api-key", "rk"]
    cmd += ["--replica", server.url, "--replica", f"http://127.0.0.1:{dead}", "--health-interval", "0.2"]
    with open(tmp_path / "router.log", "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120  # a process start: slow on a loaded machine
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, (tmp_path / "router.log").read_text()
            assert time.monotonic() < deadline, "the router never became healthy"
            time.sleep(0.05)
        auth = {"Authorization": "Bearer rk"}
        score = {"text_1": QUERY, "text_2": DOCS}
        rerank = {"query": QUERY, "documents": DOCS, "top_n": 3}
        for path, body in (
            ("/score", score),
            ("/v1/score", score),
            ("/rerank", rerank),
            ("/v2/rerank", rerank),
        ):
            assert _post(url, path, body).status_code == 401, path
            for _ in range(2):  # round robin over the two: the dead one is never answered from
                routed = _post(url, path, body, headers={**auth, "X-Request-Id": "rid-7"})
                assert routed.status_code == 200 and routed.headers["x-request-id"] == "rid-7", routed.text
                assert routed.json()["id"] == ("score-rid-7" if "score" in path else "rerank-rid-7")
                (got, got_scores), (want, want_scores) = (
                    _view(routed.json()),
                    _view(_post(server.url, path, body).json()),
                )
                assert got == want and _close(got_scores, want_scores)
    finally:
        proc.terminate()
        proc.wait(15)
