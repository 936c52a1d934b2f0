"""Split-KV paged attention for decode steps: one new token per sequence, long contexts.

Each (sequence, KV head) pair's context is cut into fixed ``split_size`` pieces handled by
separate programs, and a second kernel merges the pieces in split order. Split boundaries are
multiples of ``split_size`` whatever the batch and the merge is a fixed sum, so a row's result
is the same run to run and whatever else is in the batch (though not the same bits as
``unified_attention``, which sums in one pass). With a sliding window, splits wholly before the
window are idle and the first one the window reaches starts where the window does; an attention
chunk (Llama 4) limits the keys the same way, from the start of the query's chunk. ALiBi slopes add
``slope[h] * (k - q_pos)`` to the scores inside each split, so the merge needs nothing more.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from engine.kernels import Launch, interpreting
from engine.kernels.triton_attention import (
    attend_tiles,
    check_shapes,
    default_block_n,
    dot_precision,
    kernel_chunk,
    kernel_window,
)

DEFAULT_SPLIT_SIZE = 512  # KV positions per split: fixed, so split boundaries never depend on the batch


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    part_out_ptr,
    part_lse_ptr,
    alibi_ptr,
    scale,
    v_scale,
    softcap,
    window,
    chunk,
    queries_per_kv,
    head_dim,
    block_size,
    num_splits,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_po_t,
    stride_po_h,
    SPLIT_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Every head of the program sees the same keys: the window's, [seq_len - window, seq_len), within
    # the query's chunk.
    kv_start = tl.maximum(tl.maximum(split * SPLIT_SIZE, seq_len - window), (seq_len - 1) // chunk * chunk)
    kv_end = tl.minimum((split + 1) * SPLIT_SIZE, seq_len)
    # Splits past this sequence's end belong to longer sequences; those before its window are idle.
    if kv_start < kv_end:
        group = tl.arange(0, BLOCK_H)
        head_mask = group < queries_per_kv
        q_head = kv_head * queries_per_kv + group
        dims = tl.arange(0, BLOCK_D)
        dim_mask = dims < head_dim
        io_mask = head_mask[:, None] & dim_mask[None, :]
        q_offs = seq.to(tl.int64) * stride_qt + q_head[:, None] * stride_qh + dims[None, :]
        q = tl.load(q_ptr + q_offs, mask=io_mask, other=0.0).to(tl.float32)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        q_pos = tl.zeros([BLOCK_H], tl.int32) + (seq_len - 1)  # the one new token of each head
        slope = l_i  # unread without ALIBI
        if ALIBI:
            slope = tl.load(alibi_ptr + q_head, mask=head_mask, other=0.0).to(tl.float32)
        m_i, l_i, acc = attend_tiles(
            q, m_i, l_i, acc, q_pos, q_pos, slope, kv_start, kv_end, k_cache_ptr, v_cache_ptr,
            block_tables_ptr + seq.to(tl.int64) * stride_bt, kv_head, block_size, scale, softcap,
            stride_cb, stride_cs, stride_ch, dims, dim_mask,
            CAUSAL=False, SOFTCAP=SOFTCAP, ALIBI=ALIBI, BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION,
        )  # fmt: skip
        row = seq.to(tl.int64) * stride_po_t + q_head * stride_po_h + split
        tl.store(part_lse_ptr + row, m_i + tl.log(l_i), mask=head_mask)
        part = acc * v_scale / l_i[:, None]
        tl.store(
            part_out_ptr + row[:, None] * BLOCK_D + dims[None, :], part, mask=head_mask[:, None]
        )  # padded dims hold zeros


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    sinks_ptr,
    out_ptr,
    window,
    chunk,
    head_dim,
    stride_po_t,
    stride_po_h,
    stride_ot,
    stride_oh,
    SPLIT_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    first_split = tl.maximum(tl.maximum(seq_len - window, (seq_len - 1) // chunk * chunk), 0) // SPLIT_SIZE
    n_splits = tl.cdiv(seq_len, SPLIT_SIZE)
    row = seq.to(tl.int64) * stride_po_t + head * stride_po_h
    dims = tl.arange(0, BLOCK_D)
    # Two passes in split order: the merge is a fixed sum whatever the batch looks like.
    max_lse = tl.full([], float("-inf"), tl.float32)
    for s in range(first_split, n_splits):
        max_lse = tl.maximum(max_lse, tl.load(part_lse_ptr + row + s))
    acc = tl.zeros([BLOCK_D], tl.float32)
    total = tl.zeros([], tl.float32)
    if SINKS:  # the head's value-less softmax column (gpt-oss) joins the merge as one more split
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        max_lse = tl.maximum(max_lse, sink)
        total += tl.exp(sink - max_lse)
    for s in range(first_split, n_splits):
        weight = tl.exp(tl.load(part_lse_ptr + row + s) - max_lse)
        acc += weight * tl.load(part_out_ptr + (row + s) * BLOCK_D + dims)
        total += weight
    out = acc / tl.maximum(total, 1e-30)
    o_offs = seq.to(tl.int64) * stride_ot + head * stride_oh + dims
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=dims < head_dim)


def split_kv_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seq_len: int,
    *,
    out: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    chunk: int | None = None,
    alibi: torch.Tensor | None = None,
    split_size: int = DEFAULT_SPLIT_SIZE,
    block_n: int | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence (``q`` [B, Hq, D], row i = sequence i) over all
    ``seq_lens[i]`` cached positions (the token's own K/V included), or only the last ``window``
    of them, or only those of its attention ``chunk``, in fixed KV splits, scores plus
    ``alibi[h] * (k_pos - q_pos)`` if ALiBi slopes (fp32 [Hq]) are given; with ``sinks`` (fp32 [Hq]),
    each head's softmax has that extra value-less logit, added when the splits merge. The caches'
    values are read times ``k_scale`` / ``v_scale`` (an fp8 cache's scales, applied as
    ``unified_attention`` applies them).

    ``max_seq_len`` (a host int, >= every ``seq_lens[i]``) sizes the grid; split boundaries are
    multiples of ``split_size`` whatever the batch, and splits merge in order, so each row's
    result is the same run to run and whatever else is in the batch.
    """
    n_q_heads, n_kv_heads, head_dim = check_shapes(q, k_cache, v_cache)
    num_seqs = q.shape[0]
    if out is None:
        out = torch.empty((num_seqs, n_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_seqs == 0 or max_seq_len <= 0:
        return out
    block_d = max(16, triton.next_power_of_2(head_dim))
    if block_n is None:
        block_n = default_block_n(block_d)
    if split_size % block_n:
        raise ValueError(f"split_size {split_size} must be a multiple of block_n {block_n}")
    queries_per_kv = n_q_heads // n_kv_heads
    num_splits = triton.cdiv(max_seq_len, split_size)
    part_out = torch.empty((num_seqs, n_q_heads, num_splits, block_d), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((num_seqs, n_q_heads, num_splits), dtype=torch.float32, device=q.device)
    window, chunk = kernel_window(window), kernel_chunk(chunk)
    _decode_split_kernel[(num_seqs, n_kv_heads, num_splits)](
        q, k_cache, v_cache, seq_lens, block_tables, part_out, part_lse, q if alibi is None else alibi,
        scale * k_scale, v_scale, softcap or 0.0, window, chunk,
        queries_per_kv, head_dim, k_cache.shape[1], num_splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), part_lse.stride(0), part_lse.stride(1),
        **split_launch(
            queries_per_kv, head_dim, q.dtype, split_size, block_n, interpreting(), softcap is not None,
            alibi is not None,
        ).kwargs,
    )  # fmt: skip
    _decode_reduce_kernel[(num_seqs, n_q_heads)](
        part_out, part_lse, seq_lens, part_lse if sinks is None else sinks, out, window, chunk, head_dim,
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
        **reduce_launch(head_dim, split_size, sinks is not None).kwargs,
    )  # fmt: skip
    return out


@cache
def split_launch(
    queries_per_kv: int,
    head_dim: int,
    dtype: torch.dtype,
    split_size: int,
    block_n: int,
    interpret: bool = False,
    softcap: bool = False,
    alibi: bool = False,
) -> Launch:
    return Launch({
        "SPLIT_SIZE": split_size, "BLOCK_H": max(16, triton.next_power_of_2(queries_per_kv)), "BLOCK_N": block_n,
        "BLOCK_D": max(16, triton.next_power_of_2(head_dim)), "DOT_PRECISION": dot_precision(dtype, interpret),
        "SOFTCAP": softcap, "ALIBI": alibi,
    })  # fmt: skip


@cache
def reduce_launch(head_dim: int, split_size: int, sinks: bool = False) -> Launch:
    return Launch(
        {"SPLIT_SIZE": split_size, "BLOCK_D": max(16, triton.next_power_of_2(head_dim)), "SINKS": sinks},
        num_stages=1,
    )
