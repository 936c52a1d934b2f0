"""Reference (pure PyTorch) implementations of the model's fused ops.

``engine/kernels/triton_ops.py`` implements the same functions with the same signatures; the
model runner picks one set once at start-up (``select_ops``) and never branches per call. The
Triton set also has ``fused_moe`` (``engine/kernels/triton_moe.py``): a mixture of experts' routed
experts in two grouped matmuls; without it ``engine/models/moe.py`` loops over the experts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm in fp32, returned in the input dtype. With ``residual``: ``r = x + residual`` is
    normalised and also returned (the new residual stream)."""
    if residual is not None:
        x = x + residual
        res_out: torch.Tensor | None = x
    else:
        res_out = None
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    out = (xf * torch.rsqrt(var + eps)).to(x.dtype) * weight
    return out, res_out


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """LayerNorm (mean subtracted, then scaled by the variance's root; ``bias`` optional: Cohere has
    none) in fp32, returned in the input dtype; ``residual`` as ``rms_norm``'s. Both op sets run this
    one: the Triton backend has no LayerNorm kernel."""
    if residual is not None:
        x = x + residual
        res_out: torch.Tensor | None = x
    else:
        res_out = None
    w = None if weight is None else weight.float()  # None: no scale (OLMo 1's norms)
    b = None if bias is None else bias.float()
    out = F.layer_norm(x.float(), (x.shape[-1],), w, b, eps).to(x.dtype)
    return out, res_out


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """Rotate ``q`` [T, Hq, D] and ``k`` [T, Hkv, D] in place (NeoX / HF ``rotate_half`` style).

    ``cos_sin_cache`` row p is ``concat(cos[p, :D/2], sin[p, :D/2])`` in fp32.
    """
    half = q.shape[-1] // 2
    cs = cos_sin_cache.index_select(0, positions)
    cos = cs[:, None, :half]
    sin = cs[:, None, half:]
    for t in (q, k):
        tf = t.float()
        x1, x2 = tf[..., :half], tf[..., half:]
        t.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]`` for ``x`` of shape [T, 2I]."""
    inter = x.shape[-1] // 2
    return F.silu(x[..., :inter]) * x[..., inter:]


@dataclass(frozen=True)
class Ops:
    """One consistent set of the fused ops, picked once per engine."""

    name: str
    rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
    rotary_embedding: Callable[..., None]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    # (x, w13, w2, weights, experts, silu_and_mul) -> the routed experts' output; None: a loop
    fused_moe: Callable[..., torch.Tensor] | None = None
    # (x, weight, bias, eps, residual) -> (normed, new residual); the torch op in both sets.
    layer_norm: Callable[..., tuple[torch.Tensor, torch.Tensor | None]] = layer_norm


TORCH_OPS = Ops("torch", rms_norm, rotary_embedding, silu_and_mul)


def select_ops(backend: str) -> Ops:
    """The op set matching the attention backend: Triton kernels with "triton", else these."""
    if backend == "triton":
        from engine.kernels import triton_moe, triton_ops

        return Ops(
            "triton",
            triton_ops.rms_norm,
            triton_ops.rotary_embedding,
            triton_ops.silu_and_mul,
            triton_moe.fused_moe,
        )
    return TORCH_OPS
