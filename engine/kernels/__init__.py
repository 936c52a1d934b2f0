"""Triton kernels for ferry's GPU path: fused elementwise ops and paged attention.

* ``triton_ops``: rms_norm (+ residual), rotary embedding, silu_and_mul, paged KV-cache write;
  same signatures as ``engine/ops.py``.
* ``triton_attention``: unified paged attention for mixed batches; ``triton_decode``: split-KV decode.
* ``triton_matmul``: a batch-invariant ``F.linear``, deterministic mode's linear on CUDA.
* ``compile_check``: compiles every kernel for a CUDA architecture without a GPU.

The kernel modules import ``triton`` at import time, so nothing in the engine imports them
unless the Triton attention backend (or the Triton ops) was chosen. ``triton_usable`` is a cheap
check for choosing a backend: it never imports triton, and is False where it could not run.

On a machine without a GPU the same kernels run under Triton's interpreter
(``TRITON_INTERPRET=1``); that is how the CPU tests exercise them.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from functools import cached_property
from typing import Any


def interpreting() -> bool:
    """True when Triton runs kernels in its NumPy interpreter instead of compiling them."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_usable(device: str) -> bool:
    """Whether the Triton kernels can run for tensors on ``device`` ("cuda", "cpu", ...).

    CUDA tensors need triton installed; CPU tensors additionally need the interpreter, because
    compiled Triton kernels only target accelerators.
    """
    if importlib.util.find_spec("triton") is None:
        return False
    if device.startswith("cuda"):
        return True
    return interpreting()


@dataclass(frozen=True)
class Launch:
    """Compile-time parameters of a kernel launch: constexpr values plus warps and stages.

    Each kernel module derives these in one cached function per kernel, used both by the launch
    wrappers and by ``compile_check`` (which compiles the kernels for a GPU without having one),
    so what is checked is exactly what runs.
    """

    constexprs: dict[str, Any]
    num_warps: int = 4
    num_stages: int = 2

    def __getitem__(self, name: str) -> Any:
        return self.constexprs[name]

    @cached_property
    def kwargs(self) -> dict[str, Any]:
        return {**self.constexprs, "num_warps": self.num_warps, "num_stages": self.num_stages}
