"""A batch-invariant dense matmul, ``x @ weight.T (+ bias)``: deterministic mode's linear layers on CUDA.

cuBLAS chooses its kernel (tile shape, split-K) by the problem's size, M included, so a row's
result can change with the number of rows beside it: deterministic mode's promise (a request's
tokens do not depend on its batch) breaks on the dense layers, as a test run on an H200 showed.
Here the tiles depend on the weight's shape and the dtype only, never on M; each program owns one
output tile and runs the whole K loop in one fixed order, accumulating in fp32 (no split-K, no
atomics). A row's result is then the same in a batch of 1 or 1,000, at any position in it.

The fused MoE (``triton_moe.py``) follows the same rules for the routed experts; attention, the
norms and rotary are batch-invariant by construction (``triton_attention.py``, ``triton_ops.py``).
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from engine.kernels import Launch, interpreting


@triton.jit
def _matmul_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    m,
    n,
    k,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    CAST_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < m, cols < n
    x_base = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    w_base = w_ptr + cols[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k
        a = tl.load(x_base + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [M, K]
        b = tl.load(w_base + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [K, N]
        if CAST_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@cache
def matmul_launch(n: int, k: int, dtype: torch.dtype, has_bias: bool, interpret: bool) -> Launch:
    """Tiles from the weight's shape and the dtype alone: the rows never choose them."""
    cast = dtype == torch.float32 or interpret  # the interpreter gets half-precision dots wrong
    return Launch(
        {
            "HAS_BIAS": has_bias, "CAST_FP32": cast, "DOT_PRECISION": "ieee" if cast else "tf32",
            "BLOCK_M": 32 if cast else 64,
            "BLOCK_N": min(64 if cast else 128, max(16, triton.next_power_of_2(n))),
            "BLOCK_K": min(32 if cast else 64, max(16, triton.next_power_of_2(k))),
        },
        num_warps=4,
        num_stages=2 if cast else 3,
    )  # fmt: skip


def invariant_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` [..., K] and ``weight`` [N, K], each row's result
    independent of the other rows."""
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*lead, n)
    launch = matmul_launch(n, k, x.dtype, bias is not None, interpreting())
    grid = (triton.cdiv(m, launch["BLOCK_M"]), triton.cdiv(n, launch["BLOCK_N"]))
    _matmul_kernel[grid](
        x2, weight, bias if bias is not None else out, out, m, n, k,
        x2.stride(0), weight.stride(0), out.stride(0), **launch.kwargs,
    )  # fmt: skip
    return out.reshape(*lead, n)
