"""Multi-head latent attention (DeepSeek V2/V3, absorbed form) in Triton over the paged latent cache.

The cache holds one ``[latent | rotary key]`` row per token (``[num_blocks, block_size, 1,
v_dim + rope_dim]``: 512 + 64 for DeepSeek-V3); every query head attends over those rows, and the
values are the rows' first ``v_dim`` dims. ``mla_attention`` runs one program per (new token,
block of ``BLOCK_H`` heads): it reads the token's keys straight through the block table, tile by
tile from position 0 to its own (causal), scores ``q_latent . k_latent + q_rope . k_rope``, and
keeps an fp32 online softmax whose value tile is the key tile's latent part (read once for both).
So no step copies the batch's latent caches out (the torch path gathers them per step and layer),
and prefill chunks, prefix-hit tails and decode tokens share one launch.

Numerics: fp32 models (and the interpreter) load everything as fp32 and use exact fp32 dots;
bf16/fp16 models on a GPU multiply in their own dtype with fp32 accumulation and round the
probabilities to that dtype for the value product (FlashAttention's practice): fp32 tiles of
512-wide latents would not fit an L4's shared memory. The softmax runs in fp32. A token's result depends only on its own
sequence (tiles start at 0, tile shapes are fixed by the head and latent sizes): batch invariant.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from engine.kernels import Launch, interpreting


@triton.jit
def _mla_kernel(
    q_ptr,
    latent_cache_ptr,
    out_ptr,
    token_seq_ptr,
    token_pos_ptr,
    block_tables_ptr,
    scale,
    v_scale,
    num_heads,
    v_dim,
    rope_dim,
    block_size,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_bt,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_R: tl.constexpr,
    CAST_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    seq = tl.load(token_seq_ptr + token).to(tl.int64)
    pos = tl.load(token_pos_ptr + token)
    head_ok = heads < num_heads
    dv = tl.arange(0, BLOCK_V)
    dv_ok = dv < v_dim
    dr = tl.arange(0, BLOCK_R)
    dr_ok = dr < rope_dim
    q_row = q_ptr + token * stride_qt + heads[:, None] * stride_qh
    q_lat = tl.load(q_row + dv[None, :], mask=head_ok[:, None] & dv_ok[None, :], other=0.0)
    q_rot = tl.load(q_row + v_dim + dr[None, :], mask=head_ok[:, None] & dr_ok[None, :], other=0.0)
    if CAST_FP32:
        q_lat = q_lat.to(tl.float32)
        q_rot = q_rot.to(tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_V], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    for tile in range(0, pos + 1, BLOCK_N):
        keys = tile + tl.arange(0, BLOCK_N)
        key_ok = keys <= pos
        blocks = tl.load(table + keys // block_size, mask=key_ok, other=0).to(tl.int64)
        rows = latent_cache_ptr + blocks * stride_cb + (keys % block_size) * stride_cs
        k_lat = tl.load(rows[:, None] + dv[None, :], mask=key_ok[:, None] & dv_ok[None, :], other=0.0)
        k_rot = tl.load(rows[:, None] + v_dim + dr[None, :], mask=key_ok[:, None] & dr_ok[None, :], other=0.0)
        if CAST_FP32:
            k_lat = k_lat.to(tl.float32)
            k_rot = k_rot.to(tl.float32)
        else:  # an fp8 cache is widened to the queries' dtype (a no-op when they match)
            k_lat = k_lat.to(q_lat.dtype)
            k_rot = k_rot.to(q_rot.dtype)
        scores = tl.dot(q_lat, tl.trans(k_lat), input_precision=DOT_PRECISION)
        scores = tl.dot(q_rot, tl.trans(k_rot), scores, input_precision=DOT_PRECISION) * scale
        scores = tl.where(key_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(k_lat.dtype), k_lat, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    out = acc * v_scale / l_i[:, None]
    o_offs = token * stride_ot + heads[:, None] * stride_oh + dv[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & dv_ok[None, :])


@cache
def mla_launch(v_dim: int, rope_dim: int, dtype: torch.dtype, interpret: bool) -> Launch:
    block_v = max(16, triton.next_power_of_2(v_dim))
    cast = dtype == torch.float32 or interpret  # the interpreter gets half-precision dots wrong
    return Launch(
        {
            "BLOCK_H": 16, "BLOCK_N": 16 if block_v >= 256 else 32, "BLOCK_V": block_v,
            "BLOCK_R": max(16, triton.next_power_of_2(rope_dim)), "CAST_FP32": cast,
            "DOT_PRECISION": "ieee" if cast else "tf32",
        },
        num_warps=8 if block_v >= 256 else 4,
        num_stages=1,
    )  # fmt: skip


def token_positions(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each new token's sequence and absolute position (int32), on the device, no host sync."""
    device = query_start_loc.device
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    seqs = torch.repeat_interleave(
        torch.arange(q_lens.numel(), device=device), q_lens, output_size=num_tokens
    )
    first_pos = (seq_lens - q_lens)[seqs]  # the position of the sequence's first new token
    positions = torch.arange(num_tokens, device=device) - query_start_loc[:-1][seqs] + first_pos
    return seqs.to(torch.int32), positions.to(torch.int32)


def mla_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    token_seq: torch.Tensor,
    token_pos: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    v_dim: int,
    kv_scale: float = 1.0,
) -> torch.Tensor:
    """``q`` [T, H, v_dim + rope_dim] (latent query | rotary query per head) attending causally
    over ``cache`` [num_blocks, block_size, 1, v_dim + rope_dim] (the new tokens' rows already
    written); token t belongs to sequence ``token_seq[t]`` at position ``token_pos[t]``. The cache's
    rows are read times ``kv_scale`` (an fp8 cache's scale: it joins the softmax scale for the keys
    and multiplies the output for the values, which are the same rows). Returns [T, H, v_dim]."""
    num_tokens, num_heads, width = q.shape
    out = torch.empty((num_tokens, num_heads, v_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    launch = mla_launch(v_dim, width - v_dim, q.dtype, interpreting())
    grid = (num_tokens, triton.cdiv(num_heads, launch["BLOCK_H"]))
    _mla_kernel[grid](
        q, cache, out, token_seq, token_pos, block_tables, scale * kv_scale, kv_scale,
        num_heads, v_dim, width - v_dim, cache.shape[1],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        cache.stride(0), cache.stride(1), block_tables.stride(0), **launch.kwargs,
    )  # fmt: skip
    return out
