"""Edges of the pooling routes. Their length limits (``/v1/embeddings``, ``/score``, ``/rerank``,
``/classify``) on replicas whose KV cache holds fewer tokens than the model's positions
(``--num-kv-blocks 8 --block-size 4``: 32 tokens a sequence, which ``/v1/models`` advertises as
``max_model_len``): an input past those 32 tokens is the route's 400 naming the input and both
numbers, never the engine's refusal of its KV blocks; ``truncate_prompt_tokens`` past the model's
``max_model_len`` (1024) is a 400 naming it, as vLLM answers, on every pooling route. An
embedding's ``float`` values are the float32 values its ``base64`` bytes carry."""

from __future__ import annotations

import base64
import struct
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine.tokenizer import Tokenizer

SMALL_KV = ["--num-kv-blocks", "8", "--block-size", "4"]  # 32 tokens a sequence
LONG = " ".join(str(i) for i in range(20))  # more than 32 tokens, fewer than 1024


@pytest.fixture(scope="module")
def embedder(tiny_llama: Path, serve_logs: Path, server_process) -> Iterator:
    # Declared a Matryoshka model (vLLM's --hf-overrides), so ``dimensions`` is allowed.
    args = [*SMALL_KV, "--hf-overrides", '{"is_matryoshka": true}']
    srv = server_process(tiny_llama, args, serve_logs).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reranker(tiny_cross_encoder: Path, serve_logs: Path, server_process) -> Iterator:
    srv = server_process(tiny_cross_encoder, SMALL_KV, serve_logs).start()
    yield srv
    srv.stop()


def _error(srv, path: str, body: dict) -> dict:
    r = httpx.post(srv.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    return r.json()["error"]


def _context(srv) -> int:
    return httpx.get(srv.url + "/v1/models", timeout=30).json()["data"][0]["max_model_len"]


def test_an_input_past_the_kv_capacity_is_the_routes_400(embedder, tiny_llama: Path) -> None:
    assert _context(embedder) == 32
    ok = httpx.post(embedder.url + "/v1/embeddings", json={"input": list(range(10, 41))}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 31, ok.text
    err = _error(embedder, "/v1/embeddings", {"input": [[5, 6], list(range(10, 43))]})
    assert (err["param"], err["code"]) == ("input", "context_length_exceeded")
    assert err["message"] == (
        "This model's maximum context length is 32 tokens, but an input has 33 tokens. "
        "Shorten it or set truncate_prompt_tokens."
    )
    n = len(Tokenizer.from_dir(tiny_llama).encode(LONG))
    assert n > 32
    for path, body, param in (
        ("/score", {"text_1": LONG, "text_2": "b"}, "text_1"),
        ("/rerank", {"query": "q", "documents": ["a", LONG]}, "documents"),
    ):
        err = _error(embedder, path, body)
        assert (err["param"], err["code"]) == (param, "context_length_exceeded")
        assert err["message"] == (
            f"This model's maximum context length is 32 tokens, but a text has {n} tokens. "
            "Shorten it or set truncate_prompt_tokens."
        )
    # truncate_prompt_tokens keeps what fits.
    cut = httpx.post(
        embedder.url + "/v1/embeddings", json={"input": LONG, "truncate_prompt_tokens": 32}, timeout=60
    )
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 32, cut.text


def test_truncate_prompt_tokens_past_max_model_len_is_a_400(embedder, reranker) -> None:
    want = "truncate_prompt_tokens (1025) is greater than this model's maximum context length (1024)"
    for srv, path, body in (
        (embedder, "/v1/embeddings", {"input": "x"}),
        (embedder, "/score", {"text_1": "a", "text_2": "b"}),
        (embedder, "/rerank", {"query": "a", "documents": ["b"]}),
        (reranker, "/classify", {"input": "x"}),
        (reranker, "/score", {"text_1": "a", "text_2": "b"}),
        (reranker, "/rerank", {"query": "a", "documents": ["b"]}),
    ):
        err = _error(srv, path, {**body, "truncate_prompt_tokens": 1025})
        assert (err["param"], err["message"]) == ("truncate_prompt_tokens", want), path
        ok = httpx.post(srv.url + path, json={**body, "truncate_prompt_tokens": 1024}, timeout=60)
        assert ok.status_code == 200, ok.text


def test_a_cross_encoder_pair_past_the_kv_capacity_is_the_routes_400(reranker) -> None:
    assert _context(reranker) == 32
    err = _error(reranker, "/classify", {"input": list(range(10, 43))})
    assert err["param"] == "input"
    assert err["message"].startswith("This model's maximum context length is 32 tokens, but an input has 33 ")
    err = _error(reranker, "/rerank", {"query": "q", "documents": ["a", LONG]})
    assert (err["param"], err["code"]) == ("documents", "context_length_exceeded")
    assert err["message"].startswith("This model's maximum context length is 32 tokens, but a pair has ")
    # -1 keeps max_model_len's 1024 tokens: still past the 32 this replica holds.
    err = _error(reranker, "/score", {"text_1": LONG * 60, "text_2": "b", "truncate_prompt_tokens": -1})
    assert "but a pair has 1024 tokens" in err["message"]


def test_float_and_base64_embeddings_are_the_same_float32_values(embedder) -> None:
    """vLLM lists a float32 tensor: ``encoding_format: float`` gives exactly the values the base64
    bytes decode to, normalised or not, with or without ``dimensions``."""
    for extra in ({}, {"dimensions": 8}, {"normalize": False}, {"normalize": False, "dimensions": 5}):
        body = {"input": [[5, 6, 7], [300, 301]], **extra}
        floats = httpx.post(embedder.url + "/v1/embeddings", json=body, timeout=60).json()["data"]
        packed = httpx.post(
            embedder.url + "/v1/embeddings", json={**body, "encoding_format": "base64"}, timeout=60
        ).json()["data"]
        for f, b in zip(floats, packed, strict=True):
            raw = base64.b64decode(b["embedding"])
            assert len(raw) == 4 * len(f["embedding"]) == 4 * extra.get("dimensions", 64)
            assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == f["embedding"], extra
