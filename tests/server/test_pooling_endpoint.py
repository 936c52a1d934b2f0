"""vLLM's ``POST /pooling`` on the pooling models ferry serves: on an embedding model each input's
data is exactly the ``/v1/embeddings`` vector of the same input (texts, token ids, chat messages,
truncated, raw with ``use_activation: false``), on a classifier exactly ``/classify``'s
probabilities (or logits), as float32 in both encodings; usage counts the prompts' tokens; the
response is vLLM's shape (``pool-`` id, ``object: pooling`` items); every bad request is a 400 that
leaves the replica idle."""

from __future__ import annotations

import base64
import struct
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from engine.tokenizer import Tokenizer
from tests.server.conftest import metric_value

TEXTS = ["def parse_args(argv):", "import os\nimport sys\n\nprint(sys.argv)", "x = 1"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]


def _post(srv, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, headers=headers, timeout=60)


def _ok(srv, path: str, body: dict) -> dict:
    r = _post(srv, path, body)
    assert r.status_code == 200, r.text
    return r.json()


def _floats(packed: str) -> list[float]:
    raw = base64.b64decode(packed)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


def _usage(tokens: int) -> dict:
    """vLLM's UsageInfo as its pooling routes answer it."""
    return {
        "prompt_tokens": tokens,
        "total_tokens": tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
    }


def _f32(values: list[float]) -> list[float]:
    return np.asarray(values, dtype=np.float64).astype(np.float32).tolist()


# Batch-invariant numerics: an input's vector is the same bits whatever it was batched with and
# whether its prefix was cached, so two routes' answers compare exactly.
ARGS = ["--deterministic", "--num-kv-blocks", "64"]


@pytest.fixture(scope="module")
def server(tiny_llama: Path, serve_logs: Path, server_process) -> Iterator:
    srv = server_process(tiny_llama, ARGS, serve_logs).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def classifier(tiny_llama_cls: Path, serve_logs: Path, server_process) -> Iterator:
    srv = server_process(tiny_llama_cls, ARGS, serve_logs).start()
    yield srv
    srv.stop()


def test_embedding_model_pools_as_v1_embeddings(server, tiny_llama: Path) -> None:
    tok = Tokenizer.from_dir(tiny_llama)
    ids = [tok.encode(t) for t in TEXTS]
    r = _post(server, "/pooling", {"model": server.model_name, "input": TEXTS}, {"X-Request-Id": "abc-1"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"id", "object", "created", "model", "data", "usage"}
    assert body["id"] == "pool-abc-1" and body["object"] == "list" and isinstance(body["created"], int)
    assert body["model"] == server.model_name
    tokens = sum(len(i) for i in ids)
    assert body["usage"] == _usage(tokens)
    want = _ok(server, "/v1/embeddings", {"input": TEXTS, "encoding_format": "float"})["data"]
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert all(d["object"] == "pooling" for d in body["data"])
    assert [d["data"] for d in body["data"]] == [w["embedding"] for w in want]
    assert len(body["data"][0]["data"]) == 64
    # Token ids (one list, several lists), base64, and the raw state without the activation.
    one = _ok(server, "/pooling", {"input": ids[1]})
    assert one["data"][0]["data"] == want[1]["embedding"] and one["usage"]["prompt_tokens"] == len(ids[1])
    packed = _ok(server, "/pooling", {"input": ids, "encoding_format": "base64"})["data"]
    assert [_floats(d["data"]) for d in packed] == [w["embedding"] for w in want]
    raw = _ok(server, "/v1/embeddings", {"input": ids, "encoding_format": "float", "normalize": False})[
        "data"
    ]
    for off in ({"use_activation": False}, {"normalize": False}):
        got = _ok(server, "/pooling", {"input": ids, **off})["data"]
        assert [d["data"] for d in got] == [w["embedding"] for w in raw]


def test_truncation_and_messages(server) -> None:
    cut = _ok(server, "/pooling", {"input": TEXTS[1], "truncate_prompt_tokens": 3})
    want = _ok(server, "/v1/embeddings", {"input": TEXTS[1], "truncate_prompt_tokens": 3})
    assert cut["data"][0]["data"] == want["data"][0]["embedding"]
    assert cut["usage"] == _usage(3)
    # Messages: the chat template's rendering, without a generation prompt unless asked for.
    prompts = []
    for extra in ({}, {"add_generation_prompt": True}):
        ids = _ok(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False, **extra})[
            "tokens"
        ]
        got = _ok(server, "/pooling", {"messages": MESSAGES, **extra})
        want = _ok(server, "/v1/embeddings", {"input": ids})
        assert got["data"] == [{"index": 0, "object": "pooling", "data": want["data"][0]["embedding"]}]
        assert got["usage"] == _usage(len(ids))
        prompts.append(ids)
    assert len(prompts[1]) > len(prompts[0]) and prompts[1][: len(prompts[0])] == prompts[0]


def test_embeddings_take_chat_messages(server) -> None:
    """vLLM's chat-shaped embedding request: the messages rendered as ``/tokenize`` renders them
    (no generation prompt unless asked), embedded as that one prompt; both inputs at once is a 400."""
    for extra in ({}, {"add_generation_prompt": True}):
        ids = _ok(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False, **extra})[
            "tokens"
        ]
        got = _ok(server, "/v1/embeddings", {"messages": MESSAGES, "encoding_format": "float", **extra})
        want = _ok(server, "/v1/embeddings", {"input": ids, "encoding_format": "float"})
        assert got["data"] == want["data"] and got["usage"] == _usage(len(ids))
    r = _post(server, "/v1/embeddings", {"messages": MESSAGES, "input": "x"})
    assert r.status_code == 400 and "exactly one of 'input' or 'messages'" in r.json()["error"]["message"]


def test_classifier_pools_as_classify(classifier, tiny_llama_cls: Path) -> None:
    ids = [Tokenizer.from_dir(tiny_llama_cls).encode(t) for t in TEXTS]
    for flags in ({}, {"use_activation": False}):
        want = _ok(classifier, "/classify", {"input": TEXTS, **flags})["data"]
        got = _ok(classifier, "/pooling", {"input": TEXTS, **flags})
        assert [d["data"] for d in got["data"]] == [_f32(w["probs"]) for w in want]
        tokens = sum(len(i) for i in ids)
        assert got["usage"] == _usage(tokens)
        packed = _ok(classifier, "/pooling", {"input": ids, "encoding_format": "base64", **flags})["data"]
        assert [_floats(d["data"]) for d in packed] == [_f32(w["probs"]) for w in want]
    probs = _ok(classifier, "/pooling", {"input": TEXTS[0], "task": "classify"})["data"][0]["data"]
    assert len(probs) == 3 and abs(sum(probs) - 1.0) < 1e-6  # the config's softmax over the 3 labels


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": "x", "messages": MESSAGES}, "messages", "exactly one of 'input' or 'messages'"),
        ({"model": "m"}, "input", "exactly one of 'input' or 'messages'"),
        ({"input": "x", "dimensions": 8}, "dimensions", "dimensions is not supported on /pooling"),
        ({"input": "x", "task": "classify"}, "task", "this model's pooling task is 'embed'"),
        ({"input": "x", "task": "token_embed"}, "task", "'token_embed' is not served"),
        ({"input": "x", "encoding_format": "binary"}, "encoding_format", ""),
        ({"input": []}, "input", "must not be empty"),
        ({"input": ["ok", ""]}, "input", "empty strings"),
        ({"input": [[1, 2], [99999]]}, "input", "out of range"),
        ({"input": [5] * 1025}, "input", "maximum context length is 1024 tokens"),
        ({"input": "x", "truncate_prompt_tokens": 5000}, "truncate_prompt_tokens", "greater than"),
        ({"input": "x", "use_activation": "no"}, "use_activation", ""),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages",
            "image content parts are not supported",
        ),
    ],
)
def test_bad_requests_are_400s(server, body: dict, param: str, words: str) -> None:
    r = _post(server, "/pooling", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and words in err["message"]
    assert param in (err["param"] or "")
    text = httpx.get(server.url + "/metrics", timeout=10).text
    assert metric_value(text, "vllm:num_requests_running") == 0.0


def test_unknown_model_and_classifier_mistakes(server, classifier) -> None:
    r = _post(server, "/pooling", {"input": "x", "model": "nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    for body, param, words in (
        ({"input": "x", "normalize": False}, "normalize", "a classifier's activation is use_activation"),
        ({"input": "x", "task": "embed"}, "task", "this model's pooling task is 'classify'"),
    ):
        r = _post(classifier, "/pooling", body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param and words in r.json()["error"]["message"]
