"""SageMaker's ``/invocations`` on a classifier, where vLLM's order of trials (the request types of
the endpoints the model serves, pooling last) reaches ``/pooling``: a chat-shaped body (``messages``,
no ``input``) is served by ``/pooling`` (a classifier serves no chat; ferry's ``/classify`` takes no
messages), answering what ``/pooling`` answers for it, its mistakes ``/pooling``'s 400s; an
``input`` body stays ``/classify``'s even when it names a pooling ``task``, or has ``messages`` or
``prompt`` too (vLLM tries no generation request type on a classifier). ``/classify`` and
``/pooling`` answer vLLM's usage; a classifier's probabilities encode like embeddings."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from engine.tokenizer import Tokenizer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
TEXTS = ["def parse_args(argv):", "x = 1"]


@pytest.fixture(scope="module")
def classifier(tiny_llama_cls: Path, serve_logs: Path, server_process) -> Iterator:
    # Batch-invariant numerics: a prompt's probabilities are the same bits in every request.
    srv = server_process(tiny_llama_cls, ["--deterministic", "--num-kv-blocks", "64"], serve_logs).start()
    yield srv
    srv.stop()


def _post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=60)


def _ok(srv, path: str, body: dict) -> dict:
    r = _post(srv, path, body)
    assert r.status_code == 200, r.text
    return r.json()


def _same(a: dict, b: dict) -> bool:
    volatile = ("id", "created")
    return {k: v for k, v in a.items() if k not in volatile} == {
        k: v for k, v in b.items() if k not in volatile
    }


def test_a_chat_shaped_body_is_pooled(classifier) -> None:
    for extra in ({}, {"use_activation": False}, {"encoding_format": "base64", "embed_dtype": "float16"}):
        body = {"messages": MESSAGES, **extra}
        via = _ok(classifier, "/invocations", body)
        direct = _ok(classifier, "/pooling", body)
        assert _same(via, direct) and via["id"].startswith("pool-")
        assert via["data"][0]["object"] == "pooling"
    probs = _ok(classifier, "/invocations", {"messages": MESSAGES})["data"][0]["data"]
    assert len(probs) == 3 and abs(sum(probs) - 1.0) < 1e-6  # the config's softmax over 3 labels
    # Chat-only fields are ignored, as vLLM's pooling request ignores them.
    chatty = _ok(classifier, "/invocations", {"messages": MESSAGES, "max_tokens": 5, "temperature": 0})
    assert chatty["data"][0]["data"] == probs
    # Its mistakes are /pooling's own 400s.
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    for body, param in (
        ({"messages": image}, "messages"),
        ({"messages": MESSAGES, "embed_dtype": "int8"}, "embed_dtype"),
        ({"messages": MESSAGES, "task": "embed"}, "task"),
    ):
        r = _post(classifier, "/invocations", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_an_input_body_stays_classify(classifier) -> None:
    direct = _ok(classifier, "/classify", {"input": TEXTS})
    for extra in ({}, {"task": "classify", "encoding_format": "base64"}):
        via = _ok(classifier, "/invocations", {"input": TEXTS, **extra})
        assert _same(via, direct) and via["id"].startswith("classify-")
        assert set(via["data"][0]) == {"index", "label", "probs", "num_classes"}
    # A prompt body is still completions' (a classifier does not generate: its 400).
    r = _post(classifier, "/invocations", {"prompt": "x", "max_tokens": 2})
    assert r.status_code == 400 and "classifier" in r.json()["error"]["message"]


def test_usage_and_encodings_on_a_classifier(classifier, tiny_llama_cls: Path) -> None:
    n = sum(len(Tokenizer.from_dir(tiny_llama_cls).encode(t)) for t in TEXTS)
    full = {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0, "prompt_tokens_details": None}
    probs = [d["probs"] for d in _ok(classifier, "/classify", {"input": TEXTS})["data"]]
    assert _ok(classifier, "/classify", {"input": TEXTS})["usage"] == full
    pooled = _ok(
        classifier, "/pooling", {"input": TEXTS, "encoding_format": "base64", "embed_dtype": "float16"}
    )
    assert pooled["usage"] == full
    for d, p in zip(pooled["data"], probs, strict=True):
        assert base64.b64decode(d["data"]) == np.float32(p).astype(np.float16).tobytes()
    r = _post(classifier, "/pooling", {"input": TEXTS, "encoding_format": "bytes", "endianness": "big"})
    assert r.status_code == 200
    assert r.content == b"".join(np.float32(p).astype(">f4").tobytes() for p in probs)


def test_generation_fields_count_last_on_a_classifier(classifier) -> None:
    # vLLM tries only the request types of the tasks a classifier serves, ignoring unknown fields, so
    # a body with `input` and `messages` (or `prompt`) is classified; it went to chat (or
    # completions) here and was their 400 ("This model is a sequence classifier").
    direct = _ok(classifier, "/classify", {"input": TEXTS})
    for extra in (
        {"messages": MESSAGES},
        {"prompt": "x", "max_tokens": 2},
        {"messages": MESSAGES, "prompt": "x"},
    ):
        via = _ok(classifier, "/invocations", {"input": TEXTS, **extra})
        assert _same(via, direct) and via["id"].startswith("classify-")
    # Its mistakes are /classify's 400s, naming classify's field.
    r = _post(classifier, "/invocations", {"input": [], "messages": MESSAGES})
    assert r.status_code == 400
    assert r.json()["error"] == {
        "message": "input must not be empty",
        "type": "BadRequestError",
        "param": "input",
        "code": "invalid_value",
    }
    # `query` and `prompt`: rerank's own answer (on this three-label classifier, its 400).
    r = _post(classifier, "/invocations", {"query": "a cat", "documents": ["a cat", "a car"], "prompt": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    assert r.json()["error"]["message"].startswith("This classifier has 3 labels: scoring and reranking")
    # Generation fields alone still reach their endpoint, for its 400.
    r = _post(classifier, "/invocations", {"prompt": "x"})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        "This model is a sequence classifier: it does not generate text. Use /classify."
    )
