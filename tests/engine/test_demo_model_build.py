"""The demo model is built into the cache directory atomically: a build that fails or is
interrupted (Ctrl-C during a first `ferry up` or `ferry serve`) leaves nothing behind."""

from __future__ import annotations

from pathlib import Path

import pytest

import engine.demo as demo


@pytest.mark.parametrize("stop", [KeyboardInterrupt, OSError])
def test_a_stopped_build_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop) -> None:
    monkeypatch.setenv("FERRY_CACHE_DIR", str(tmp_path))

    def half_build(out: Path, **spec) -> None:  # noqa: ANN003
        (Path(out) / "config.json").write_text("{}")  # part of the model is written, then it stops
        raise stop("stopped")

    monkeypatch.setattr(demo, "build_model", half_build)
    with pytest.raises(stop):
        demo.demo_model_dir()
    assert list(tmp_path.iterdir()) == []  # no half-built model, no temporary directory
    assert not demo.demo_model_path().exists()
