"""Attention backends by name. Adding one is a new file plus one line in ``_BACKENDS``.

Imports are lazy so that choosing "torch" never imports Triton, and "triton" is only imported
where it can run.
"""

from __future__ import annotations

import importlib
import importlib.util

from engine.attention.base import AttentionBackend

_BACKENDS: dict[str, str] = {
    "torch": "engine.attention.torch_backend:TorchAttentionBackend",
    "triton": "engine.attention.triton_backend:TritonAttentionBackend",
}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def resolve_backend_name(name: str, device: str) -> str:
    """``auto`` means Triton on CUDA where Triton is installed, else the torch backend.

    On CPU ``auto`` is always "torch": the Triton interpreter is a correctness tool, not a
    serving path. Triton is optional, so its availability is checked without importing it.
    """
    if name == "auto":
        if device.startswith("cuda"):
            from engine.kernels import triton_usable

            if triton_usable(device):
                return "triton"
        return "torch"
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of: auto, {', '.join(available_backends())}"
        )
    return name


def get_attention_backend(name: str, device: str, *, deterministic: bool = False) -> AttentionBackend:
    resolved = resolve_backend_name(name, device)
    if resolved == "triton" and importlib.util.find_spec("triton") is not None:
        from engine.kernels import triton_usable

        if not triton_usable(device):
            # The engine's device, not the machine's: a CPU engine on a GPU box would otherwise
            # start, then fail its first step handing CPU tensors to compiled kernels.
            raise RuntimeError(
                f"attention_backend='triton' runs on a CUDA device (or on CPU under TRITON_INTERPRET=1); "
                f"this engine's device is {device!r}: use attention_backend='torch' there"
            )
    module_name, cls_name = _BACKENDS[resolved].split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(deterministic=deterministic)
