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


def test_triton_on_a_cpu_engine_is_refused_at_start_even_where_cuda_is_present(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check is the engine's device, not the machine's: on a GPU box a CPU engine asked for the
    Triton backend would start, then hand CPU tensors to compiled kernels at its first step."""
    pytest.importorskip("triton", reason="triton is not installed")
    import torch

    from engine.attention import get_attention_backend

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="this engine's device is 'cpu'"):
        get_attention_backend("triton", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert get_attention_backend("triton", "cpu").name == "triton"
