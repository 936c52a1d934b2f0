"""Choosing the attention backend: "auto" picks Triton only on CUDA with Triton installed."""

from __future__ import annotations

import sys

import pytest

from engine.attention import resolve_backend_name


def test_auto_is_torch_on_cpu_even_with_the_triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_backend_name("auto", "cpu") == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend_name("auto", "cpu") == "torch"


def test_auto_on_cuda_without_triton_is_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry in sys.modules makes ``triton`` unimportable (find_spec returns None).
    monkeypatch.setitem(sys.modules, "triton", None)
    assert resolve_backend_name("auto", "cuda") == "torch"
    assert resolve_backend_name("auto", "cuda:1") == "torch"


def test_auto_on_cuda_with_triton_is_triton() -> None:
    pytest.importorskip("triton", reason="triton is not installed")
    assert resolve_backend_name("auto", "cuda:0") == "triton"


def test_explicit_names() -> None:
    assert resolve_backend_name("torch", "cuda") == "torch"
    assert resolve_backend_name("triton", "cpu") == "triton"
    with pytest.raises(
        ValueError, match=r"unknown attention backend 'flash'; choose one of: auto, torch, triton"
    ):
        resolve_backend_name("flash", "cpu")
