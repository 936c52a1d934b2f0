"""``POST /v1/load_lora_adapter`` with an ``adapter_config.json`` that PEFT's loader would choke on:
a scale that is not a finite number (Python's json reads ``NaN``, ``Infinity`` and ``1e400``; every
output of the adapter would be NaN), an ``alpha_pattern`` key that is not a regular expression, or
a weight with no rank (a scalar ``lora_A``, a rank-0 pair).
Each is a 400 naming ``lora_path`` and the field, never a 500 nor an adapter served; the
replica's adapters and answers stay as they were."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.demo import build_lora_adapter

GREEDY = {"prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, tiny_llama: Path) -> Path:
    return build_lora_adapter(tmp_path_factory.mktemp("lora") / "good", tiny_llama, seed=3, rank=8, alpha=16)


@pytest.fixture(scope="module")
def lora_replica(tiny_llama: Path, adapter: Path, serve_logs: Path, server_process) -> Iterator:
    flags = ["--enable-lora", "--allow-runtime-lora-updating", "--lora-modules", f"good={adapter}"]
    srv = server_process(tiny_llama, [*flags, "--num-kv-blocks", "64"], serve_logs).start()
    yield srv
    srv.stop()


def _with_config(adapter: Path, dst: Path, config_text: str) -> Path:
    shutil.copytree(adapter, dst)
    (dst / "adapter_config.json").write_text(config_text)
    return dst


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        ('"lora_alpha": NaN', "lora_alpha must be a finite number, got nan"),
        ('"lora_alpha": 1e400', "lora_alpha must be a finite number, got inf"),
        ('"lora_alpha": -Infinity', "lora_alpha must be a finite number, got -inf"),
        ('"lora_alpha": 1' + "0" * 400, "lora_alpha must be a finite number, got 1000"),
        ('"alpha_pattern": {"q_proj": Infinity}', "alpha_pattern['q_proj'] must be a finite number, got inf"),
        ('"alpha_pattern": {"(q_proj": 8}', "alpha_pattern key '(q_proj' is not a regular expression"),
    ],
)
def test_a_config_that_cannot_scale_is_lora_paths_400(
    lora_replica, adapter: Path, tmp_path: Path, edit: str, words: str
) -> None:
    before = httpx.post(lora_replica.url + "/v1/completions", json={**GREEDY, "model": "good"}, timeout=60)
    config = json.loads((adapter / "adapter_config.json").read_text())
    text = json.dumps({k: v for k, v in config.items() if k != edit.split('"')[1]})
    bad = _with_config(adapter, tmp_path / "bad", text[:-1] + ", " + edit + "}")
    r = httpx.post(
        lora_replica.url + "/v1/load_lora_adapter",
        json={"lora_name": "bad", "lora_path": str(bad)},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "lora_path" and err["type"] == "BadRequestError"
    assert err["message"].startswith(f"LoRA adapter 'bad' ({bad}): ") and words in err["message"]
    models = httpx.get(lora_replica.url + "/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in models] == ["llama", "good"]
    after = httpx.post(lora_replica.url + "/v1/completions", json={**GREEDY, "model": "good"}, timeout=60)
    assert after.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]


@pytest.mark.parametrize(
    ("shapes", "words"),
    [
        ("scalar", "has lora_A () and lora_B (64, 8); this model needs [r, 64] and [64, r] with r >= 1"),
        ("rank0", "has lora_A (0, 64) and lora_B (64, 0); this model needs [r, 64] and [64, r] with r >= 1"),
    ],
)
def test_a_weight_without_a_rank_is_lora_paths_400(
    lora_replica, adapter: Path, tmp_path: Path, shapes: str, words: str
) -> None:
    """A ``lora_A`` that is a scalar, or a rank-0 pair (whose scale ``alpha / r`` divides by 0)."""
    bad = tmp_path / "bad"
    shutil.copytree(adapter, bad)
    weights = load_file(bad / "adapter_model.safetensors")
    a_key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    if shapes == "scalar":
        weights[a_key] = torch.tensor(1.0)
    else:
        weights[a_key] = torch.zeros(0, 64)
        weights[a_key.replace("lora_A", "lora_B")] = torch.zeros(64, 0)
    save_file(weights, bad / "adapter_model.safetensors")
    r = httpx.post(
        lora_replica.url + "/v1/load_lora_adapter",
        json={"lora_name": "bad", "lora_path": str(bad)},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "lora_path"
    assert err["message"] == f"LoRA adapter 'bad' ({bad}): model.layers.0.self_attn.q_proj {words}"
    assert [m["id"] for m in httpx.get(lora_replica.url + "/v1/models", timeout=30).json()["data"]] == [
        "llama",
        "good",
    ]
