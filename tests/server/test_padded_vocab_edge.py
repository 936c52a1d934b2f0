"""A checkpoint whose embedding is padded past the tokenizer's vocabulary (as real ones are):
prompt ids in the padding are refused at the HTTP edge with a 400, streamed or not, never with
an error event inside a 200 stream."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

PAD = 8


@pytest.fixture(scope="module")
def padded_server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory, server_process, serve_logs):
    out = tmp_path_factory.mktemp("padded-serve")
    for f in tiny_llama.iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    cfg = json.loads((out / "config.json").read_text())
    weights = load_file(str(out / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        weights[name] = torch.cat([weights[name], weights[name][:PAD]]).contiguous()
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    vocab = cfg["vocab_size"]
    cfg["vocab_size"] = vocab + PAD
    (out / "config.json").write_text(json.dumps(cfg))
    srv = server_process(out, ["--num-kv-blocks", "64"], serve_logs).start()
    yield srv, vocab
    srv.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_padding_ids_are_a_400_at_the_edge(padded_server, stream: bool) -> None:
    srv, vocab = padded_server
    body = {"prompt": [5, 6, vocab], "max_tokens": 2, "stream": stream}
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert f"token id {vocab} is out of range [0, {vocab})" in r.json()["error"]["message"]
    ok = httpx.post(srv.url + "/v1/completions", json={**body, "prompt": [5, 6, vocab - 1]}, timeout=60)
    assert ok.status_code == 200
