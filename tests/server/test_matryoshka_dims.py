"""``dimensions`` on ``/v1/embeddings`` only for Matryoshka models, as vLLM allows it: a model whose
config says nothing is a 400 naming ``dimensions`` (directly and through ``/invocations``), one that
lists ``matryoshka_dimensions`` takes only those sizes; where the facts come from (config.json,
``--hf-overrides`` merged over it, else the sentence-transformers config) and that a malformed list
is refused at load."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from engine.models.config import ModelConfig, read_hf_config
from engine.pooler import Matryoshka, resolve_matryoshka
from tests.server.conftest import metric_value

IDS = [5, 6, 7, 300, 301]


def _write_config(path: Path, **keys: object) -> Path:
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, **keys}))
    return path


@pytest.fixture(scope="module")
def listed(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_llama's weights under a config that lists its Matryoshka sizes."""
    path = shutil.copytree(tiny_llama, tmp_path_factory.mktemp("mrl") / "tiny_llama_mrl")
    return _write_config(path, matryoshka_dimensions=[8, 16, 64])


@pytest.fixture(scope="module")
def mrl_server(listed: Path, serve_logs: Path, server_process) -> Iterator:
    srv = server_process(listed, ["--num-kv-blocks", "64"], serve_logs).start()
    yield srv
    srv.stop()


def _embed(srv, **body: object) -> httpx.Response:
    return httpx.post(srv.url + "/v1/embeddings", json={"input": IDS, **body}, timeout=60)


def test_config_facts(tiny_llama: Path, tmp_path: Path) -> None:
    plain = ModelConfig.from_dir(tiny_llama)
    assert (plain.is_matryoshka, plain.matryoshka_dimensions) == (False, None)
    assert resolve_matryoshka(plain, tiny_llama) is None
    flagged = ModelConfig.from_dir(tiny_llama, {"is_matryoshka": True})
    assert (flagged.is_matryoshka, flagged.matryoshka_dimensions) == (True, None)
    assert resolve_matryoshka(flagged, tiny_llama) == Matryoshka(None)
    sizes = ModelConfig.from_dict({**read_hf_config(tiny_llama), "matryoshka_dimensions": [32, 8]})
    assert (sizes.is_matryoshka, sizes.matryoshka_dimensions) == (True, (32, 8))
    assert resolve_matryoshka(sizes, tiny_llama) == Matryoshka((32, 8))
    for bad in ([8, "16"], [0], 64, [True]):
        with pytest.raises(ValueError, match="matryoshka_dimensions must be a list of positive integers"):
            ModelConfig.from_dir(tiny_llama, {"matryoshka_dimensions": bad})
    # A config.json that says nothing defers to the sentence-transformers config.
    st = tmp_path / "config_sentence_transformers.json"
    st.write_text(json.dumps({"matryoshka_dimensions": [16, 32]}))
    assert resolve_matryoshka(plain, tmp_path) == Matryoshka((16, 32))
    st.write_text(json.dumps({"is_matryoshka": True}))
    assert resolve_matryoshka(plain, tmp_path) == Matryoshka(None)
    st.write_text(json.dumps({"prompts": {}}))
    assert resolve_matryoshka(plain, tmp_path) is None


def test_a_model_that_is_not_matryoshka_refuses_dimensions(server) -> None:
    for path, body in (
        ("/v1/embeddings", {"input": IDS, "dimensions": 8}),
        ("/invocations", {"input": IDS, "dimensions": 8}),  # SageMaker's path to the same handler
    ):
        r = httpx.post(server.url + path, json=body, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "dimensions" and err["type"] == "BadRequestError"
        assert err["message"].startswith(
            f'Model "{server.model_name}" does not support matryoshka representation'
        )
    text = httpx.get(server.url + "/metrics", timeout=10).text
    assert metric_value(text, "vllm:num_requests_running") == 0.0
    full = _embed(server)
    assert full.status_code == 200 and len(full.json()["data"][0]["embedding"]) == 64


def test_listed_sizes_only(mrl_server) -> None:
    raw = np.asarray(_embed(mrl_server, normalize=False).json()["data"][0]["embedding"], dtype=np.float64)
    for size in (8, 16, 64):
        r = _embed(mrl_server, dimensions=size)
        assert r.status_code == 200, r.text
        want = raw[:size] / np.linalg.norm(raw[:size])
        assert r.json()["data"][0]["embedding"] == want.astype(np.float32).tolist()
        assert r.json()["usage"] == {
            "prompt_tokens": len(IDS),
            "total_tokens": len(IDS),
            "completion_tokens": 0,
            "prompt_tokens_details": None,
        }
    for size in (5, 32, 65):
        r = _embed(mrl_server, dimensions=size)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "dimensions"
        assert err["message"] == (
            f'Model "tiny_llama_mrl" supports only the matryoshka dimensions 8, 16, 64, not {size}'
        )
