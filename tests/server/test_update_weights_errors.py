"""``POST /update_weights_from_disk`` refusals name the field at fault (the OpenAI error's
``param``): a ``load_format`` a weight update cannot read is ``load_format``'s, refused before
the engine is asked; a checkpoint that cannot replace the weights is ``model_path``'s."""

from __future__ import annotations

from pathlib import Path

import httpx


def _error(server, body: dict) -> dict:
    r = httpx.post(server.url + "/update_weights_from_disk", json=body, timeout=30)
    assert r.status_code == 400, r.text
    return r.json()["error"]


def test_a_bad_load_format_is_load_formats_fault(server, tiny_llama: Path) -> None:
    for model_path in (str(tiny_llama), "/no/such/dir"):  # named before the path is looked at
        assert _error(server, {"model_path": model_path, "load_format": "pt"}) == {
            "message": "load_format 'pt' is not supported for a weight update; use auto or safetensors",
            "type": "BadRequestError",
            "param": "load_format",
            "code": "invalid_value",
        }


def test_a_bad_checkpoint_is_model_paths_fault(server) -> None:
    assert _error(server, {"model_path": "/no/such/dir", "load_format": "safetensors"}) == {
        "message": "model_path '/no/such/dir' is not a directory",
        "type": "BadRequestError",
        "param": "model_path",
        "code": "invalid_value",
    }
