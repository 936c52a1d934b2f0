"""A batch-invariant ``F.linear``: ``x @ weight.T (+ bias)`` whose rows never depend on the batch.

cuBLAS chooses its kernel, tile shape and split-K by the problem size, M included, so on a GPU
a row's result changes with the number of rows sharing the call, and ``--deterministic`` would
not hold. Here nothing depends on M:

* tile sizes come from (N, K, dtype) only (``matmul_launch``);
* one program per (row block, column block) output tile, over a plain grid;
* each program reduces over K in one fixed order, ``BLOCK_K`` at a time, accumulating in fp32 (no
  split-K, no atomics), then adds the bias in fp32 and rounds once to the output dtype.

fp32 inputs multiply in true fp32 (``input_precision="ieee"``), never TF32. ``weight`` is
[out, in], as the checkpoints store it. ``engine/models/llama.py``'s ``invariant_linear`` sends
CUDA inputs here.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from engine.kernels import Launch, interpreting
from engine.kernels.triton_attention import dot_precision


@triton.jit
def tile_dot(
    a_rows,
    b_cols,
    row_ok,
    col_ok,
    k_end,
    k,
    stride_bk,
    CAST_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The fp32 [BLOCK_M, BLOCK_N] product of a row tile and a column tile over ``k`` features,
    ``BLOCK_K`` at a time in increasing order: ``a_rows`` [BLOCK_M, 1] points at the rows' first
    feature (contiguous along K), ``b_cols`` [1, BLOCK_N] at the weight rows' (an [out, in] weight,
    ``stride_bk`` apart along K: 1, or a per-head [in, out] matrix's row length). Stops at ``k_end``
    (<= k; 0 skips the tile). Shared with ``triton_moe``."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k
        a = tl.load(a_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(
            b_cols + ks[:, None] * stride_bk, mask=k_ok[:, None] & col_ok[None, :], other=0.0
        )  # [K, N]
        if CAST_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _matmul_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    m,
    n,
    k,
    stride_x,
    stride_w,
    stride_wk,
    stride_out,
    stride_xb,
    stride_wb,
    stride_ob,
    HAS_BIAS: tl.constexpr,
    CAST_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < m
    col_ok = cols < n
    batch = tl.program_id(2).to(tl.int64)  # a head of ``per_head_matmul`` (0 for ``linear``)
    x_rows = x_ptr + batch * stride_xb + rows[:, None].to(tl.int64) * stride_x
    w_cols = w_ptr + batch * stride_wb + cols[None, :].to(tl.int64) * stride_w
    acc = tile_dot(
        x_rows, w_cols, row_ok, col_ok, k, k, stride_wk, CAST_FP32, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K
    )
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + batch * stride_ob + rows[:, None].to(tl.int64) * stride_out + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@cache
def matmul_launch(n: int, k: int, dtype: torch.dtype, has_bias: bool, interpret: bool) -> Launch:
    """Tiles for an [*, k] x [k, n] product: never a function of the row count. 16-bit inputs
    take 128x128x64 tiles (tensor-core sized for Ampere/Hopper); fp32 (and every interpreted run,
    which multiplies in fp32) smaller ones, as fp32 tiles take twice the shared memory."""
    cast = dtype == torch.float32 or interpret  # the interpreter gets half-precision dots wrong
    block_m, block_n, block_k = (64, 64, 32) if cast else (128, 128, 64)
    return Launch(
        {
            "HAS_BIAS": has_bias, "CAST_FP32": cast, "DOT_PRECISION": dot_precision(dtype, interpret),
            "BLOCK_M": block_m, "BLOCK_N": min(block_n, max(16, triton.next_power_of_2(n))),
            "BLOCK_K": min(block_k, max(16, triton.next_power_of_2(k))),
        },
        num_warps=4 if cast else 8,
        num_stages=3,
    )  # fmt: skip


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` [..., in], ``weight`` [out, in], ``bias`` [out],
    in ``x``'s dtype; each row's result is the same whatever other rows share the call."""
    n, k = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*lead, n)
    launch = matmul_launch(n, k, x.dtype, bias is not None, interpreting())
    grid = (triton.cdiv(m, launch["BLOCK_M"]), triton.cdiv(n, launch["BLOCK_N"]))
    _matmul_kernel[grid](
        x2, weight, bias if bias is not None else weight, out,
        m, n, k, x2.stride(0), weight.stride(0), 1, out.stride(0), 0, 0, 0,
        **launch.kwargs,
    )  # fmt: skip
    return out.view(*lead, n)


def per_head_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x[t, h] @ w[h]`` for ``x`` [T, H, a] and ``w`` [H, a, b] -> [T, H, b] (``torch.bmm`` over
    heads, as DeepSeek's absorbed latent attention multiplies), each token's result the same
    whatever other tokens share the call: one grid slice per head, each as ``linear``'s."""
    t, heads, k = x.shape
    if w.shape[:2] != (heads, k):
        raise ValueError(f"x is [T, {heads}, {k}], w {list(w.shape)}: expected [{heads}, {k}, b]")
    n = w.shape[2]
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    out = torch.empty(t, heads, n, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    launch = matmul_launch(n, k, x.dtype, False, interpreting())
    grid = (triton.cdiv(t, launch["BLOCK_M"]), triton.cdiv(n, launch["BLOCK_N"]), heads)
    _matmul_kernel[grid](
        x, w, w, out, t, n, k,
        x.stride(0), 1, w.stride(1), out.stride(0), x.stride(1), w.stride(0), out.stride(1),
        **launch.kwargs,
    )  # fmt: skip
    return out
