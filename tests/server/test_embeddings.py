"""POST /v1/embeddings through the official SDK against the session's replica (tiny Llama):
last-token pooling equal to transformers' last hidden state, normalised; float and base64
encodings; several inputs in order; ``dimensions`` (on a Matryoshka replica: ``--hf-overrides``
``is_matryoshka``); usage; every bad input a 400 that costs nothing."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from engine.tokenizer import Tokenizer
from tests.server.conftest import metric_value

TEXTS = ["def parse_args(argv):", "import os\nimport sys\n\nprint(sys.argv)", "x = 1"]


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> list[torch.Tensor]:
    """transformers' last hidden state of each text's last token, L2-normalised."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    tok = Tokenizer.from_dir(tiny_llama)
    out = []
    with torch.no_grad():
        for text in TEXTS:
            h = model(torch.tensor([tok.encode(text)])).last_hidden_state[0, -1]
            out.append(h / h.norm())
    return out


@pytest.fixture(scope="module")
def mrl(tiny_llama: Path, serve_logs: Path, server_process) -> Iterator:
    """tiny_llama declared a Matryoshka model (vLLM's ``--hf-overrides``): ``dimensions`` allowed."""
    args = ["--hf-overrides", '{"is_matryoshka": true}', "--num-kv-blocks", "64"]
    srv = server_process(tiny_llama, args, serve_logs).start()
    yield srv
    srv.stop()


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _close(got: list[float], want: torch.Tensor, tol: float = 1e-5) -> bool:
    return float((torch.tensor(got) - want).abs().max()) < tol


def test_embeddings_equal_transformers_in_both_encodings(client, server, reference, tiny_llama) -> None:
    floats = client.embeddings.create(model=server.model_name, input=TEXTS, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1, 2] and floats.object == "list"
    for d, want in zip(floats.data, reference, strict=True):
        assert len(d.embedding) == 64 and _close(d.embedding, want)
        assert math.isclose(math.fsum(x * x for x in d.embedding), 1.0, rel_tol=1e-6)
    tok = Tokenizer.from_dir(tiny_llama)
    tokens = sum(len(tok.encode(t)) for t in TEXTS)
    assert (floats.usage.prompt_tokens, floats.usage.total_tokens) == (tokens, tokens)
    default = client.embeddings.create(model=server.model_name, input=TEXTS)  # the SDK asks for base64
    for a, b in zip(default.data, floats.data, strict=True):
        assert _close(a.embedding, torch.tensor(b.embedding), 1e-7)  # float32 round trip


def test_token_inputs_dimensions_and_prefix_hits(client, server, mrl, reference, tiny_llama) -> None:
    ids = Tokenizer.from_dir(tiny_llama).encode(TEXTS[1])
    by_ids = client.embeddings.create(model=server.model_name, input=[ids, ids], encoding_format="float")
    for d in by_ids.data:  # the second is a prefix-cache hit of the first: same vector
        assert _close(d.embedding, reference[1])
    short = _client(mrl).embeddings.create(
        model=mrl.model_name, input=ids, dimensions=8, encoding_format="float"
    )
    want = reference[1][:8] / reference[1][:8].norm()
    assert len(short.data[0].embedding) == 8 and _close(short.data[0].embedding, want)


def test_normalize_false_gives_the_raw_state(client, server, mrl, tiny_llama) -> None:
    """vLLM's ``normalize: false``: the pooled state as the model left it (truncated by
    ``dimensions``, not rescaled), in either encoding."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    ids = Tokenizer.from_dir(tiny_llama).encode(TEXTS[0])
    with torch.no_grad():
        raw = model(torch.tensor([ids])).last_hidden_state[0, -1]
    for fmt in ({"encoding_format": "float"}, {}):  # without one the SDK asks for base64 and decodes it
        got = client.embeddings.create(
            model=server.model_name, input=ids, extra_body={"normalize": False}, **fmt
        )
        assert _close(got.data[0].embedding, raw)
    short = _client(mrl).embeddings.create(
        model=mrl.model_name,
        input=ids,
        dimensions=8,
        encoding_format="float",
        extra_body={"normalize": False},
    )
    assert _close(short.data[0].embedding, raw[:8])
    assert abs(math.fsum(x * x for x in short.data[0].embedding) - 1.0) > 1e-3  # not rescaled


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": []}, "input", "must not be empty"),
        ({"input": ["ok", ""]}, "input", "empty strings"),
        ({"input": [[1, 2], [99999]]}, "input", "out of range"),
        ({"input": "x", "dimensions": 65, "mrl": True}, "dimensions", "more than this model's 64"),
        ({"input": "x", "dimensions": 0}, "dimensions", ""),
        ({"input": "x", "dimensions": 8}, "dimensions", "does not support matryoshka"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format", ""),
        ({"input": [5] * 1025}, "input", "maximum context length is 1024 tokens"),
        ({"input": 7}, "input", ""),
        ({"input": "x", "normalize": "no"}, "normalize", ""),
    ],
)
def test_bad_inputs_are_400s(server, mrl, body: dict, param: str, words: str) -> None:
    srv = mrl if body.get("mrl") else server  # "mrl": on the Matryoshka replica
    body = {k: v for k, v in body.items() if k != "mrl"}
    r = httpx.post(srv.url + "/v1/embeddings", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and words in err["message"]
    assert param in (err["param"] or "")


def test_unknown_model_is_404_and_the_replica_stays_idle(server) -> None:
    r = httpx.post(server.url + "/v1/embeddings", json={"input": "x", "model": "nope"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    text = httpx.get(server.url + "/metrics", timeout=10).text
    assert metric_value(text, "vllm:num_requests_running") == 0.0
    assert metric_value(text, "vllm:kv_cache_usage_perc") == 0.0


def test_pooling_type_flag_mean(tiny_llama: Path, serve_logs: Path, server_process) -> None:
    """`ferry serve --pooling-type mean`: the average of every prompt token's final state, normalised."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    tok = Tokenizer.from_dir(tiny_llama)
    with torch.no_grad():
        states = [model(torch.tensor([tok.encode(t)])).last_hidden_state[0].mean(dim=0) for t in TEXTS]
    srv = server_process(tiny_llama, ["--pooling-type", "mean", "--num-kv-blocks", "128"], serve_logs).start()
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        got = c.embeddings.create(model=srv.model_name, input=TEXTS, encoding_format="float")
        for d, want in zip(got.data, states, strict=True):
            assert _close(d.embedding, want / want.norm())
    finally:
        srv.stop()
