"""``/classify`` with chat ``messages`` (vLLM's ClassificationChatRequest), and SageMaker's
``/invocations`` on a classifier, in vLLM's order of trials (the request types of the endpoints the
model serves, classify before pooling): a chat-shaped body (``messages``, no ``input``) is
classified, its mistakes ``/classify``'s 400s; an ``input`` body stays ``/classify``'s even when it
names a pooling ``task``, or has ``messages`` or ``prompt`` too (vLLM tries no generation request
type on a classifier). ``/classify`` and
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


def test_classify_takes_chat_messages(classifier) -> None:
    """vLLM's ClassificationChatRequest: the messages rendered as ``/tokenize`` renders them (no
    generation prompt unless asked), classified as that one prompt."""
    for extra in ({}, {"add_generation_prompt": True}, {"use_activation": False}):
        flags = {"add_generation_prompt": extra.get("add_generation_prompt", False)}
        ids = _ok(classifier, "/tokenize", {"messages": MESSAGES, **flags})["tokens"]
        got = _ok(classifier, "/classify", {"messages": MESSAGES, **extra})
        want = _ok(classifier, "/classify", {"input": ids, **extra})
        assert _same(got, want) and got["usage"]["prompt_tokens"] == len(ids)
    r = _post(classifier, "/classify", {"messages": MESSAGES, "input": "x"})
    assert r.status_code == 400 and "exactly one of 'input' or 'messages'" in r.json()["error"]["message"]


def test_a_chat_shaped_body_is_classified(classifier) -> None:
    # vLLM tries classify before pooling, and its chat-shaped classify request takes the body.
    for extra in ({}, {"use_activation": False}):
        body = {"messages": MESSAGES, **extra}
        via = _ok(classifier, "/invocations", body)
        assert _same(via, _ok(classifier, "/classify", body)) and via["id"].startswith("classify-")
    probs = _ok(classifier, "/invocations", {"messages": MESSAGES})["data"][0]["probs"]
    assert len(probs) == 3 and abs(sum(probs) - 1.0) < 1e-6  # the config's softmax over 3 labels
    # Chat-only and pooling-only fields are ignored, as vLLM's classify request ignores them.
    for extra in ({"max_tokens": 5, "temperature": 0}, {"task": "embed", "embed_dtype": "int8"}):
        chatty = _ok(classifier, "/invocations", {"messages": MESSAGES, **extra})
        assert chatty["data"][0]["probs"] == probs
    # Its mistakes are /classify's own 400s.
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    r = _post(classifier, "/invocations", {"messages": image})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


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
