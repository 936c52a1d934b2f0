"""Triton versions of the engine's elementwise ops (same signatures as ``engine/ops.py``).

rms_norm (optionally fused with the residual add), NeoX-style rotary embedding from a
precomputed cos/sin cache, SiLU-and-multiply for gated MLPs, and the paged KV-cache write.

Every kernel loads its inputs, converts them to fp32 at once and computes in fp32 (the Triton
interpreter gets bf16 arithmetic wrong, and fp32 is what the PyTorch reference does inside).
Block shapes depend only on the feature sizes, never on the number of tokens, so a row's result
is the same whatever else is in the batch (the engine's ``--deterministic`` promise).
This module must not import anything from the engine: the engine imports it, not the reverse.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from engine.kernels import Launch

# Elements one program instance handles at most in the row-wise kernels. Large blocks keep
# the grid small, which matters most under the interpreter (cost per program instance).
_MAX_BLOCK_ELEMS = 8192


def _rows_per_program(block_cols: int) -> int:
    return max(1, min(64, _MAX_BLOCK_ELEMS // block_cols))


def _num_warps(block_elems: int) -> int:
    # About 16 values per thread: enough loads in flight to saturate memory without spilling.
    warps = max(1, block_elems // (32 * 16))
    return min(16, 1 << (warps.bit_length() - 1))  # a power of two, as Triton requires


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


# --------------------------------------------------------------------------- rms_norm


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    n_rows,
    n_cols,
    stride_x,
    stride_res,
    stride_out,
    stride_res_out,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_H)
    col_mask = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + rows[:, None] * stride_res + cols[None, :], mask=mask, other=0.0)
        # Round the sum to the activation dtype before normalising, exactly as the eager
        # `hidden = hidden + residual` does; the stored residual is that rounded sum.
        summed = (x + res.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + rows[:, None] * stride_res_out + cols[None, :], summed, mask=mask)
        x = summed.to(tl.float32)
    variance = tl.sum(x * x, axis=1) / n_cols
    rstd = 1.0 / tl.sqrt(variance + eps)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    # Round the normalised value to the activation dtype before the weight, as HF's RMSNorm
    # (and engine/ops.py) do, so half-precision results round where the eager path rounds.
    normed = (x * rstd[:, None]).to(out_ptr.dtype.element_ty).to(tl.float32)
    y = normed * w[None, :]
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm over the last dim of ``x`` [T, H]; with ``residual``: normalise ``x + residual``.

    Returns ``(normed, None)`` or ``(normed, x + residual)``; both new tensors in ``x``'s dtype.
    """
    x = _last_dim_contiguous(x)
    n_rows, n_cols = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    launch = rms_norm_launch(n_cols, residual is not None)
    grid = (triton.cdiv(n_rows, launch["BLOCK_T"]),)
    if residual is None:
        if n_rows:
            _rms_norm_kernel[grid](
                x, x, weight, out, out, n_rows, n_cols, x.stride(0), 0, out.stride(0), 0, eps, **launch.kwargs
            )  # fmt: skip
        return out, None
    residual = _last_dim_contiguous(residual)
    res_out = torch.empty_like(out)
    if n_rows:
        _rms_norm_kernel[grid](
            x, residual, weight, out, res_out, n_rows, n_cols,
            x.stride(0), residual.stride(0), out.stride(0), res_out.stride(0), eps, **launch.kwargs,
        )  # fmt: skip
    return out, res_out


@cache
def rms_norm_launch(n_cols: int, has_residual: bool) -> Launch:
    block_h = triton.next_power_of_2(n_cols)
    block_t = _rows_per_program(block_h)
    return Launch(
        {"HAS_RESIDUAL": has_residual, "BLOCK_T": block_t, "BLOCK_H": block_h},
        num_warps=_num_warps(block_t * block_h),
    )


# --------------------------------------------------------------------------- rotary


@triton.jit
def _rotate_heads(
    base_ptr, n_heads, stride_h, half, cos, sin, BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr
):
    heads = tl.arange(0, BLOCK_HEADS)
    offs = tl.arange(0, BLOCK_HALF)
    mask = (heads < n_heads)[:, None] & (offs < half)[None, :]
    first = base_ptr + heads[:, None] * stride_h + offs[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + half, mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * cos[None, :] - x2 * sin[None, :]
    out2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(first, out1.to(base_ptr.dtype.element_ty), mask=mask)
    tl.store(first + half, out2.to(base_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cache_ptr,
    n_q_heads,
    n_k_heads,
    half,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cache,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0)
    pos = tl.load(positions_ptr + token)
    offs = tl.arange(0, BLOCK_HALF)
    row = cache_ptr + pos * stride_cache
    cos = tl.load(row + offs, mask=offs < half, other=0.0).to(tl.float32)
    sin = tl.load(row + half + offs, mask=offs < half, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + token * stride_qt, n_q_heads, stride_qh, half, cos, sin, BLOCK_QH, BLOCK_HALF)
    _rotate_heads(k_ptr + token * stride_kt, n_k_heads, stride_kh, half, cos, sin, BLOCK_KH, BLOCK_HALF)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """Rotate ``q`` [T, Hq, D] and ``k`` [T, Hkv, D] in place (NeoX / HF ``rotate_half`` pairs).

    Row ``p`` of ``cos_sin_cache`` is ``cat(cos[p, :R/2], sin[p, :R/2])`` for a rotary width
    ``R`` (normally ``D``); dims past ``R`` are left as they are (partial rotary).
    """
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        # The kernel addresses the head dim contiguously; rotate copies and write them back.
        q_c, k_c = q.contiguous(), k.contiguous()
        rotary_embedding(positions, q_c, k_c, cos_sin_cache)
        q.copy_(q_c)
        k.copy_(k_c)
        return
    n_tokens = q.shape[0]
    if n_tokens == 0:
        return
    rot_dim = cos_sin_cache.shape[-1]
    if rot_dim % 2 or rot_dim > q.shape[-1] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"cos_sin_cache width {rot_dim} does not fit head dim {q.shape[-1]}/{k.shape[-1]}")
    half = rot_dim // 2
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    _rotary_kernel[(n_tokens,)](
        positions, q, k, cache, q.shape[1], k.shape[1], half,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cache.stride(0),
        **rotary_launch(q.shape[1], k.shape[1], half).kwargs,
    )  # fmt: skip


@cache
def rotary_launch(n_q_heads: int, n_k_heads: int, half: int) -> Launch:
    return Launch({
        "BLOCK_QH": triton.next_power_of_2(n_q_heads), "BLOCK_KH": triton.next_power_of_2(n_k_heads),
        "BLOCK_HALF": triton.next_power_of_2(half),
    })  # fmt: skip


# --------------------------------------------------------------------------- silu_and_mul


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, n_rows, inter, stride_x, stride_out, BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (rows < n_rows)[:, None] & (cols < inter)[None, :]
    gate_ptr = x_ptr + rows[:, None] * stride_x + cols[None, :]
    gate = tl.load(gate_ptr, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptr + inter, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]`` for ``x`` [T, 2I]; returns a new [T, I] tensor."""
    x = _last_dim_contiguous(x)
    n_rows, width = x.shape
    if width % 2:
        raise ValueError(f"silu_and_mul needs an even last dim, got {width}")
    inter = width // 2
    out = torch.empty((n_rows, inter), dtype=x.dtype, device=x.device)
    if n_rows == 0:
        return out
    launch = silu_and_mul_launch(inter)
    grid = (triton.cdiv(n_rows, launch["BLOCK_T"]), triton.cdiv(inter, launch["BLOCK_I"]))
    _silu_and_mul_kernel[grid](x, out, n_rows, inter, x.stride(0), out.stride(0), **launch.kwargs)
    return out


@cache
def silu_and_mul_launch(inter: int) -> Launch:
    block_i = min(triton.next_power_of_2(inter), 4096)
    block_t = _rows_per_program(block_i)
    return Launch({"BLOCK_T": block_t, "BLOCK_I": block_i}, num_warps=_num_warps(block_t * block_i))


# --------------------------------------------------------------------------- KV cache write


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale,
    v_scale,
    n_heads,
    head_dim,
    block_size,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8_MAX: tl.constexpr,  # an fp8 cache's largest finite value; 0: the cache is not fp8
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:  # negative slots are padding tokens: nothing to store
        heads = tl.arange(0, BLOCK_HEADS)
        dims = tl.arange(0, BLOCK_D)
        mask = (heads < n_heads)[:, None] & (dims < head_dim)[None, :]
        src = heads[:, None] * stride_kh + dims[None, :]
        k = tl.load(k_ptr + token * stride_kt + src, mask=mask, other=0.0)
        src = heads[:, None] * stride_vh + dims[None, :]
        v = tl.load(v_ptr + token * stride_vt + src, mask=mask, other=0.0)
        dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs
        dst += heads[:, None] * stride_ch + dims[None, :]
        if FP8_MAX > 0:  # x / scale, correctly rounded in fp32 as torch divides, saturated (to_cache)
            k = tl.clamp(tl.math.div_rn(k.to(tl.float32), k_scale), -FP8_MAX, FP8_MAX)
            v = tl.clamp(tl.math.div_rn(v.to(tl.float32), v_scale), -FP8_MAX, FP8_MAX)
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store ``k``/``v`` [T, Hkv, D] at ``slot_mapping`` [T] in the paged caches
    [num_blocks, block_size, Hkv, D]; slots < 0 (padding) are skipped. fp8 caches hold
    ``k / k_scale`` and ``v / v_scale`` as ``engine.attention.base.to_cache`` stores them."""
    n_tokens = k.shape[0]
    if n_tokens == 0:
        return
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must share one layout with a contiguous head dim")
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    _, block_size, n_heads, head_dim = k_cache.shape
    fp8_max = torch.finfo(k_cache.dtype).max if k_cache.element_size() == 1 else 0.0
    _write_kv_kernel[(n_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale, n_heads, head_dim, block_size,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), **write_kv_launch(n_heads, head_dim, fp8_max).kwargs,
    )  # fmt: skip


@cache
def write_kv_launch(n_heads: int, head_dim: int, fp8_max: float = 0.0) -> Launch:
    return Launch({
        "BLOCK_HEADS": triton.next_power_of_2(n_heads), "BLOCK_D": triton.next_power_of_2(head_dim),
        "FP8_MAX": fp8_max,
    })  # fmt: skip
