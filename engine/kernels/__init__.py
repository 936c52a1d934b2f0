"""Triton kernels for ferry's GPU path: fused elementwise ops and paged attention.

The kernel modules import ``triton`` at import time, so nothing in the engine imports them
unless the Triton attention backend (or the Triton ops) was chosen. ``triton_usable`` is the
one cheap check the engine makes before choosing: it never imports triton when it is absent.

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
