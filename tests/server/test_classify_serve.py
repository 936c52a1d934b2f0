"""Sequence classifiers behind ``ferry serve`` (httpx: the OpenAI SDK has no classify): ``/classify``
answers transformers' softmax (three labels) or sigmoid (one) with the config's labels, for texts
and token ids; ``/score`` and ``/rerank`` on a one-label classifier (a cross-encoder) score each pair
as one input, transformers' sigmoid of the pair encoding's logit, counting the pairs' tokens;
client mistakes are 4xx in OpenAI's shape; generation and embeddings on a classifier, ``/classify``
on a decoder and scoring on a three-label classifier are clear 400s."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from engine.tokenizer import Tokenizer

TEXTS = ["def parse_args(argv):", "import os\nimport sys\n\nprint(sys.argv)", "x = 1"]
QUERY = "def parse_args(argv):"
DOCS = ["import argparse\nparser = argparse.ArgumentParser()", "x = 1", "def parse(argv):", "print(x)"]
LONG = " ".join(str(i) for i in range(1500))  # more than the tiny models' 1024 positions


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def _hf_logits(path: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0] for p in prompts]


def _close(got: list[float], want: torch.Tensor | list[float], tol: float = 1e-5) -> bool:
    want = torch.as_tensor(want, dtype=torch.float64)
    return len(got) == len(want) and float((torch.tensor(got, dtype=torch.float64) - want).abs().max()) < tol


def _error(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


@pytest.fixture(scope="module")
def classifier(tiny_llama_cls: Path, serve_logs: Path, server_process) -> Iterator:
    srv = server_process(tiny_llama_cls, ["--num-kv-blocks", "256"], serve_logs).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reranker(tiny_cross_encoder: Path, serve_logs: Path, server_process) -> Iterator:
    srv = server_process(tiny_cross_encoder, ["--num-kv-blocks", "256"], serve_logs).start()
    yield srv
    srv.stop()


def test_classify_equals_transformers_softmax(classifier, tiny_llama_cls: Path) -> None:
    tok = Tokenizer.from_dir(tiny_llama_cls)
    ids = [tok.encode(t) for t in TEXTS]
    want = [torch.softmax(w, -1) for w in _hf_logits(tiny_llama_cls, ids)]
    names = ["negative", "neutral", "positive"]
    for path in ("/classify", "/v1/classify"):
        r = _post(classifier.url, path, {"model": classifier.model_name, "input": TEXTS})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["id"].startswith("classify-") and body["object"] == "list"
        assert body["model"] == classifier.model_name and isinstance(body["created"], int)
        tokens = sum(len(i) for i in ids)
        assert body["usage"] == {
            "prompt_tokens": tokens,
            "total_tokens": tokens,
            "completion_tokens": 0,
            "prompt_tokens_details": None,
        }
        assert [d["index"] for d in body["data"]] == [0, 1, 2]
        for d, w in zip(body["data"], want, strict=True):
            assert d["num_classes"] == 3 and _close(d["probs"], w)
            assert d["label"] == names[int(w.argmax())]
    assert len({d["label"] for d in body["data"]}) > 1  # the labels mean something here
    # Token ids, one list or several; one string; raw logits with use_activation false.
    logits = _hf_logits(tiny_llama_cls, ids[:1])[0]
    for given in (ids[0], [ids[0], ids[0]], TEXTS[0]):
        r = _post(classifier.url, "/classify", {"input": given})
        assert r.status_code == 200, r.text
        assert all(_close(d["probs"], want[0]) for d in r.json()["data"])
    raw = _post(classifier.url, "/classify", {"input": ids[0], "use_activation": False})
    assert _close(raw.json()["data"][0]["probs"], logits, 1e-4)
    # truncate_prompt_tokens keeps each input's last tokens.
    cut = _post(classifier.url, "/classify", {"input": TEXTS[1], "truncate_prompt_tokens": 4})
    assert _close(
        cut.json()["data"][0]["probs"], torch.softmax(_hf_logits(tiny_llama_cls, [ids[1][-4:]])[0], -1)
    )
    assert cut.json()["usage"]["prompt_tokens"] == 4


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": []}, "input", "must not be empty"),
        ({"input": ["ok", ""]}, "input", "empty strings"),
        ({"input": [[5, 99999]]}, "input", "out of range"),
        ({"input": 5}, "input", ""),
        ({}, "input", ""),
        ({"input": LONG}, "input", "maximum context length is 1024 tokens"),
        ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "-1"),
        ({"input": "x", "use_activation": "no"}, "use_activation", ""),
    ],
)
def test_classify_client_mistakes_are_400s(classifier, body: dict, param: str, words: str) -> None:
    err = _error(_post(classifier.url, "/classify", body))
    assert param in (err["param"] or "") and words in err["message"], err


def test_what_a_classifier_refuses_and_stays_up(classifier) -> None:
    url = classifier.url
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for path, body in (
        ("/v1/chat/completions", chat),
        ("/v1/chat/completions", {**chat, "stream": True}),  # refused before any stream starts
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/responses", {"input": "hi"}),
    ):
        assert _error(_post(url, path, body))["message"].endswith("does not generate text. Use /classify.")
    assert _error(_post(url, "/v1/embeddings", {"input": "hi"}))["message"].endswith(
        "no embeddings. Use /classify."
    )
    for path, body in (
        ("/score", {"text_1": "a", "text_2": "b"}),
        ("/rerank", {"query": "a", "documents": ["b"]}),
    ):
        assert "has 3 labels" in _error(_post(url, path, body))["message"]
    assert _error(_post(url, "/classify", {"input": "x", "model": "nope"}), 404)["code"] == "model_not_found"
    assert httpx.get(url + "/health").status_code == 200
    assert _post(url, "/classify", {"input": "x"}).status_code == 200


def test_classify_on_a_decoder_is_a_400(server) -> None:
    err = _error(_post(server.url, "/classify", {"input": "x = 1"}))
    assert "not a sequence-classification model" in err["message"]


# -- a one-label classifier: a cross-encoder ----------------------------------------------------


def _pairs(path: Path, query: str, docs: list[str], **kw) -> list[list[int]]:
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(path))
    return [tok(text=query, text_pair=d, **kw)["input_ids"] for d in docs]


def test_score_and_rerank_read_each_pair_as_one_input(reranker, tiny_cross_encoder: Path) -> None:
    pairs = _pairs(tiny_cross_encoder, QUERY, DOCS)
    want = [float(torch.sigmoid(w)[0]) for w in _hf_logits(tiny_cross_encoder, pairs)]
    tokens = sum(len(p) for p in pairs)
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])
    assert min(want[a] - want[b] for a, b in zip(order, order[1:], strict=False)) > 1e-4
    r = _post(reranker.url, "/score", {"model": reranker.model_name, "text_1": QUERY, "text_2": DOCS})
    assert r.status_code == 200, r.text
    assert _close([d["score"] for d in r.json()["data"]], want)
    assert r.json()["usage"] == {
        "prompt_tokens": tokens,
        "total_tokens": tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
    }
    n_to_n = _post(reranker.url, "/v1/score", {"queries": [QUERY] * 4, "documents": DOCS})
    assert _close([d["score"] for d in n_to_n.json()["data"]], want)
    for path in ("/rerank", "/v2/rerank"):
        r = _post(reranker.url, path, {"query": QUERY, "documents": DOCS, "top_n": 3})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == order[:3]
        assert _close([x["relevance_score"] for x in results], [want[i] for i in order[:3]])
        assert r.json()["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    # /classify on it: the sigmoid of the logit, the config's one label.
    one = _post(reranker.url, "/classify", {"input": pairs[0]})
    assert _close(one.json()["data"][0]["probs"], [want[0]]) and one.json()["data"][0]["label"] == "LABEL_0"
    # use_activation: false (vLLM's) scores and ranks by the logits themselves.
    logits = [float(w[0]) for w in _hf_logits(tiny_cross_encoder, pairs)]
    raw = _post(reranker.url, "/score", {"text_1": QUERY, "text_2": DOCS, "use_activation": False})
    assert _close([d["score"] for d in raw.json()["data"]], logits)
    ranked = _post(reranker.url, "/rerank", {"query": QUERY, "documents": DOCS, "activation": False})
    assert _close([x["relevance_score"] for x in ranked.json()["results"]], [logits[i] for i in order])


def test_cross_encoder_truncation_and_limits(reranker, tiny_cross_encoder: Path) -> None:
    cut = _pairs(tiny_cross_encoder, QUERY, DOCS[:2], truncation=True, max_length=8)
    want = [float(torch.sigmoid(w)[0]) for w in _hf_logits(tiny_cross_encoder, cut)]
    r = _post(reranker.url, "/score", {"text_1": QUERY, "text_2": DOCS[:2], "truncate_prompt_tokens": 8})
    assert r.status_code == 200, r.text
    assert _close([d["score"] for d in r.json()["data"]], want) and r.json()["usage"]["prompt_tokens"] == 16
    whole = _post(reranker.url, "/rerank", {"query": LONG, "documents": ["x"], "truncate_prompt_tokens": -1})
    assert whole.status_code == 200 and whole.json()["usage"]["prompt_tokens"] == 1024, whole.text
    err = _error(_post(reranker.url, "/rerank", {"query": "q", "documents": ["a", LONG]}))
    assert err["param"] == "documents" and "maximum context length is 1024 tokens" in err["message"]
    err = _error(_post(reranker.url, "/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 1}))
    assert err["param"] == "truncate_prompt_tokens" and "special tokens" in err["message"]
    # A one-label classifier (a cross-encoder) names the routes that serve it.
    err = _error(_post(reranker.url, "/v1/completions", {"prompt": "hi"}))
    assert err["message"].endswith("does not generate text. Use /classify, /score or /rerank.")
