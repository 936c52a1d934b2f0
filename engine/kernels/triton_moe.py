"""The routed experts of a mixture-of-experts MLP as two grouped matmuls (gate+up, then down).

``engine/models/moe.py`` runs one matmul pair per expert that has tokens: on a GPU that is a
few kernel launches per active expert and layer (a decode step of 32 sequences with 8 of 256
experts each touches ~150 of them). Here every expert's work of a layer goes into one launch
per matmul:

* ``align``: the (token, slot) pairs sorted by expert, each expert's run padded to whole
  ``BLOCK_M``-row blocks (pad value: the number of pairs), and each row block's expert (-1 past
  the last). All on the device, no host synchronisation: the grid is an upper bound, and blocks
  past the end skip their K loop.
* ``_moe_matmul_kernel``: one program per (row block, column block) multiplies its rows by its
  expert's weight tile (weights stored [experts, out, in], as the checkpoints'), accumulating in
  fp32, optionally scaled by each pair's routing weight, and stores each row at its pair's row
  of the output. Rows are the tokens themselves for the first matmul (pair // top_k), the pairs
  for the second.
* ``fused_moe``: both matmuls around ``silu_and_mul``, then each token's slots summed.

Tile sizes depend on the feature sizes only, never on the number of tokens, and a row's dot runs
over K in a fixed order, so a token's result does not depend on its batch (``--deterministic``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch
import triton
import triton.language as tl

from engine.kernels import Launch, interpreting
from engine.kernels.triton_matmul import tile_dot

BLOCK_M = 16  # rows (token-expert pairs) per block: decode steps give each expert few rows


@triton.jit
def _moe_matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    pairs_ptr,
    block_expert_ptr,
    weight_ptr,
    num_pairs,
    n,
    k,
    stride_a,
    stride_be,
    stride_bn,
    stride_c,
    TOP_K: tl.constexpr,
    WEIGHTED: tl.constexpr,
    CAST_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    used = expert >= 0
    expert = tl.maximum(expert, 0).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + rows)
    row_ok = pairs < num_pairs
    a_rows = (pairs // TOP_K).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    b_cols = b_ptr + expert * stride_be + cols[None, :].to(tl.int64) * stride_bn
    k_end = tl.where(used, k, 0)  # a block past the last expert's: nothing to multiply
    acc = tile_dot(
        a_ptr + a_rows[:, None] * stride_a, b_cols, row_ok, col_ok, k_end, k, 1,
        CAST_FP32, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    if WEIGHTED:
        acc = acc * tl.load(weight_ptr + pairs, mask=row_ok, other=0.0)[:, None]
    out = c_ptr + pairs[:, None].to(tl.int64) * stride_c + cols[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@cache
def matmul_launch(n: int, k: int, dtype: torch.dtype, top_k: int, weighted: bool, interpret: bool) -> Launch:
    cast = dtype == torch.float32 or interpret  # the interpreter gets half-precision dots wrong
    return Launch(
        {
            "TOP_K": top_k, "WEIGHTED": weighted, "CAST_FP32": cast,
            "DOT_PRECISION": "ieee" if cast else "tf32",
            "BLOCK_M": BLOCK_M, "BLOCK_N": min(64, max(16, triton.next_power_of_2(n))),
            "BLOCK_K": min(64 if cast else 128, max(16, triton.next_power_of_2(k))),
        },
        num_warps=4,
        num_stages=2 if cast else 3,
    )  # fmt: skip


def align(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pairs, block_expert)``: pair indices (token * top_k + slot) grouped by expert, token order
    kept, each expert's run padded with ``experts.numel()`` to whole ``BLOCK_M`` blocks; and each
    block's expert, -1 for blocks past the last run. Sized for the worst case, without reading
    anything back to the host."""
    flat = experts.reshape(-1)
    num_pairs = flat.numel()
    device = flat.device
    max_blocks = triton.cdiv(num_pairs, BLOCK_M) + min(num_experts, num_pairs)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    first_of_expert = torch.cumsum(counts, 0) - counts
    rank = torch.arange(num_pairs, device=device) - first_of_expert[sorted_experts]
    dest = (padded_end - padded)[sorted_experts] + rank
    pairs = torch.full((max_blocks * BLOCK_M,), num_pairs, dtype=torch.int32, device=device)
    pairs[dest] = order.to(torch.int32)
    block_start = torch.arange(max_blocks, device=device) * BLOCK_M
    block_expert = torch.searchsorted(padded_end, block_start, right=True).to(torch.int32)
    block_expert = torch.where(block_start < padded_end[-1], block_expert, -1).to(torch.int32)
    return pairs, block_expert


def _grouped_matmul(
    a: torch.Tensor,
    w: torch.Tensor,
    pairs: torch.Tensor,
    block_expert: torch.Tensor,
    num_pairs: int,
    top_k: int,
    weights: torch.Tensor | None,
) -> torch.Tensor:
    """[num_pairs, out]: row p is ``a[p // top_k] @ w[expert of p].T`` (times ``weights[p]``)."""
    a = a if a.stride(-1) == 1 else a.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    n, k = w.shape[1], w.shape[2]
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    launch = matmul_launch(n, k, a.dtype, top_k, weights is not None, interpreting())
    grid = (block_expert.numel(), triton.cdiv(n, launch["BLOCK_N"]))
    _moe_matmul_kernel[grid](
        a, w, out, pairs, block_expert, weights if weights is not None else a,
        num_pairs, n, k, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        **launch.kwargs,
    )  # fmt: skip
    return out


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The routed experts' output for ``x`` [T, hidden]: ``w13`` [E, 2I, hidden] (gate and up),
    ``w2`` [E, hidden, I], each token's ``experts`` [T, k] and fp32 routing ``weights`` [T, k]."""
    t, top_k = experts.shape
    num_pairs = t * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    pairs, block_expert = align(experts, w13.shape[0])
    h = silu_and_mul(_grouped_matmul(x, w13, pairs, block_expert, num_pairs, top_k, None))
    flat_weights = weights.reshape(-1).float().contiguous()
    down = _grouped_matmul(h, w2, pairs, block_expert, num_pairs, 1, flat_weights)
    return down.view(t, top_k, -1).sum(dim=1, dtype=torch.float32).to(x.dtype)
