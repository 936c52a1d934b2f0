"""``--lora-modules`` refuses an adapter named as the base model (or one of its
``--served-model-name`` aliases), as ``/v1/load_lora_adapter`` does: requests naming it run the base
model, so such an adapter could never be reached, and ``/v1/models`` would list the id twice."""

from __future__ import annotations

from pathlib import Path

from engine.demo import build_lora_adapter
from tests.server.test_api_servers import _serve


def test_an_adapter_named_as_the_base_model_is_refused_at_start(tiny_llama: Path, tmp_path: Path) -> None:
    adapter = build_lora_adapter(tmp_path / "a", tiny_llama, rank=8)
    for names, clash in (([], tiny_llama.name), (["--served-model-name", "base", "alias"], "alias")):
        args = ["--model", str(tiny_llama), "--port", "0", "--enable-lora", *names]
        done = _serve([*args, "--lora-modules", f"{clash}={adapter}"])
        assert done.returncode == 2, done.stderr
        assert f"--lora-modules names '{clash}', the base model's name" in done.stderr
