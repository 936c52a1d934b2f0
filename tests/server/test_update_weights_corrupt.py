"""``POST /update_weights_from_disk`` with a checkpoint whose safetensors shard is truncated or
corrupt (a copy cut short while a trainer wrote it), or whose config.json has numbers no model can
take (0 attention heads, an infinite width): a 400 naming ``model_path`` and the reader's
complaint, never a 500, and the replica goes on serving its old weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

GREEDY = {"prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0, "ignore_eos": True}


def _copy_with_shard(src: Path, dst: Path, data: bytes) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    (dst / "model.safetensors").write_bytes(data)
    return dst


@pytest.mark.parametrize("cut", ["header", "tensors"])
def test_a_corrupt_shard_is_model_paths_400(server, tiny_llama: Path, tmp_path: Path, cut: str) -> None:
    before = httpx.post(server.url + "/v1/completions", json=GREEDY, timeout=60).json()["choices"][0]["text"]
    whole = (tiny_llama / "model.safetensors").read_bytes()
    data = whole[:6] if cut == "header" else whole[: len(whole) // 2]  # 6 bytes: not even the length
    bad = _copy_with_shard(tiny_llama, tmp_path / "bad", data)
    r = httpx.post(server.url + "/update_weights_from_disk", json={"model_path": str(bad)}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["type"]) == ("model_path", "BadRequestError")
    assert err["message"].startswith(f"model_path '{bad}': its weights cannot be read (")
    after = httpx.post(server.url + "/v1/completions", json=GREEDY, timeout=60).json()["choices"][0]["text"]
    assert after == before


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"num_attention_heads": 0, "head_dim": None}, "ZeroDivisionError"),
        ({"hidden_size": 1e400}, "OverflowError"),
    ],
)
def test_a_config_that_cannot_shape_a_model_is_model_paths_400(
    server, tiny_llama: Path, tmp_path: Path, change: dict, error: str
) -> None:
    bad = _copy_with_shard(tiny_llama, tmp_path / "bad", (tiny_llama / "model.safetensors").read_bytes())
    config = json.loads((tiny_llama / "config.json").read_text())
    # json writes 1e400 as Infinity, which Python's json reads back as the float it was.
    (bad / "config.json").write_text(json.dumps({**config, **change}))
    r = httpx.post(server.url + "/update_weights_from_disk", json={"model_path": str(bad)}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "model_path"
    assert err["message"].startswith(f"model_path '{bad}': its config.json cannot be read ({error}(")
    ok = httpx.post(server.url + "/v1/completions", json=GREEDY, timeout=60)
    assert ok.status_code == 200, ok.text
