"""Paged attention in Triton over ferry's KV-cache layout.

Two entry points, both reading K/V through the block table from caches shaped
``[num_blocks, block_size, num_kv_heads, head_dim]`` (slot = block_id * block_size + offset):

* ``unified_attention``: one launch for a whole mixed batch. Each sequence contributes
  ``q_len`` new tokens (prefill chunk, prefix-hit tail, or a single decode token); every new
  token attends causally to its sequence's cached prefix plus the new tokens up to itself.
* ``split_kv_decode_attention``: decode rows only (one query per sequence), with the KV range
  cut into fixed ``split_size`` pieces processed in parallel and merged by a second kernel in
  split order, for long contexts where one program per (sequence, KV head) is too little work.

Numerics: Q/K/V are converted to fp32 right after loading and the online softmax runs in fp32.
fp32 models use exact fp32 dots; fp16/bf16 models on a GPU use tf32 dots, which hold fp16 and
bf16 values exactly, so only the probabilities are rounded (to tf32) before the P@V product.

Batch invariance (``--deterministic``): tile shapes depend on head counts, head dim and dtype,
never on the batch; KV tiles always start at position 0 (or at a split boundary), and tiles a
row does not need are exact no-ops for it. So a token's output does not depend on which other
tokens or sequences share its launch, nor on how its own prompt was chunked. The split-KV
kernel is a different summation, so a backend wanting that guarantee must not switch between
the two per batch.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from engine.kernels import Launch, interpreting

DEFAULT_SPLIT_SIZE = 512  # KV positions per split: fixed, so split boundaries never depend on the batch


def _dot_precision(dtype: torch.dtype, interpret: bool) -> str:
    if dtype == torch.float32 or interpret:
        return "ieee"
    return "tf32"


def _default_block_n(block_d: int) -> int:
    return 64 if block_d <= 64 else 32


def _check_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    n_q_heads, head_dim = q.shape[-2], q.shape[-1]
    n_kv_heads = k_cache.shape[2]
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have one shape and layout")
    if k_cache.shape[3] != head_dim or n_q_heads % n_kv_heads:
        raise ValueError(f"q heads {n_q_heads}x{head_dim} do not fit the KV cache {tuple(k_cache.shape)}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("the head dim of q and of the KV cache must be contiguous")
    return n_q_heads, n_kv_heads, head_dim


# --------------------------------------------------------------------------- shared inner loop


@triton.jit
def _attend_tiles(
    q,
    m_i,
    l_i,
    acc,
    q_pos,
    kv_start,
    kv_end,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    kv_head,
    block_size,
    scale,
    stride_cb,
    stride_cs,
    stride_ch,
    dims,
    dim_mask,
    CAUSAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online-softmax accumulation of K/V positions [kv_start, kv_end) into (m_i, l_i, acc)."""
    for tile_start in range(kv_start, kv_end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        pos_mask = pos < kv_end
        block_ids = tl.load(block_table_ptr + pos // block_size, mask=pos_mask, other=0).to(tl.int64)
        kv_offs = block_ids * stride_cb + (pos % block_size) * stride_cs + kv_head * stride_ch
        kv_mask = pos_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offs[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        if CAUSAL:
            visible = pos_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        else:
            visible = pos_mask[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        # Every row sees position kv_start in the first tile, so m_new is finite from then on and
        # a tile with nothing visible leaves (m, l, acc) bit-for-bit unchanged (alpha == 1, p == 0).
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + kv_offs[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


# --------------------------------------------------------------------------- unified (varlen) kernel


@triton.jit
def _find_sequence(query_start_loc_ptr, q_block_id, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence owning global query block ``q_block_id``.

    Sequence s owns the grid slots from ``query_start_loc[s] // BLOCK_Q + 2 * s`` on: at least
    ``cdiv(q_len, BLOCK_Q) + 1`` of them, enough for its position-aligned query blocks, and a
    layout that needs no host-side prefix sum (the grid is ``T // BLOCK_Q + 2 * B``)."""
    # Typed scalars from the start: a Python 0 (or a num_seqs of 1, which Triton specialises to a
    # constant) would change type inside the loop when compiled.
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + 2 * mid
        if first_block <= q_block_id:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _unified_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    scale,
    num_seqs,
    queries_per_kv,
    head_dim,
    block_size,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    BLOCK_Q: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    q_block_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(query_start_loc_ptr, q_block_id, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len
    # Query blocks are aligned to absolute positions (block j holds positions j*BLOCK_Q ..), so a
    # token always sits in the same row of the same tile shape however its prompt was chunked.
    pos_block = context_len // BLOCK_Q + q_block_id - (q_start // BLOCK_Q + 2 * seq)
    if (q_len > 0) & (pos_block * BLOCK_Q < seq_len):
        # Rows of the tile: BLOCK_Q positions x BLOCK_G query heads sharing this KV head.
        rows = tl.arange(0, BLOCK_Q * BLOCK_G)
        q_pos = pos_block * BLOCK_Q + rows // BLOCK_G
        token = q_pos - context_len  # index among this step's new tokens of the sequence
        group = rows % BLOCK_G
        q_head = kv_head * queries_per_kv + group
        row_mask = (token >= 0) & (q_pos < seq_len) & (group < queries_per_kv)
        dims = tl.arange(0, BLOCK_D)
        dim_mask = dims < head_dim
        q_offs = (
            (q_start + token).to(tl.int64)[:, None] * stride_qt + q_head[:, None] * stride_qh + dims[None, :]
        )
        io_mask = row_mask[:, None] & dim_mask[None, :]
        q = tl.load(q_ptr + q_offs, mask=io_mask, other=0.0).to(tl.float32)

        m_i = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q * BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], tl.float32)
        kv_end = tl.minimum(seq_len, (pos_block + 1) * BLOCK_Q)
        m_i, l_i, acc = _attend_tiles(
            q, m_i, l_i, acc, q_pos, 0, kv_end, k_cache_ptr, v_cache_ptr,
            block_tables_ptr + seq.to(tl.int64) * stride_bt, kv_head, block_size, scale,
            stride_cb, stride_cs, stride_ch, dims, dim_mask,
            CAUSAL=True, BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION,
        )  # fmt: skip
        out = acc / tl.where(row_mask, l_i, 1.0)[:, None]
        o_offs = (
            (q_start + token).to(tl.int64)[:, None] * stride_ot + q_head[:, None] * stride_oh + dims[None, :]
        )
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=io_mask)


def unified_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    block_m: int = 64,
    block_n: int | None = None,
) -> torch.Tensor:
    """Causal attention of the new tokens ``q`` [T, Hq, D] of a batch of sequences.

    Sequence ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]`` (possibly none),
    has ``seq_lens[i]`` tokens in total after this step (its K/V already in the caches) and
    its blocks listed in ``block_tables[i]``. ``block_m`` (query rows x grouped heads per tile)
    and ``block_n`` (KV positions per tile) are powers of two and fix the numerics: keep them
    constant across steps for batch invariance.
    """
    n_q_heads, n_kv_heads, head_dim = _check_shapes(q, k_cache, v_cache)
    n_tokens = q.shape[0]
    if out is None:
        out = torch.empty((n_tokens, n_q_heads, head_dim), dtype=q.dtype, device=q.device)
    num_seqs = seq_lens.shape[0]
    if n_tokens == 0 or num_seqs == 0:
        return out
    queries_per_kv = n_q_heads // n_kv_heads
    launch = unified_launch(queries_per_kv, head_dim, q.dtype, block_m, block_n, interpreting())
    grid = (n_tokens // launch["BLOCK_Q"] + 2 * num_seqs, n_kv_heads)
    _unified_attention_kernel[grid](
        q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, scale,
        num_seqs, queries_per_kv, head_dim, k_cache.shape[1],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), **launch.kwargs,
    )  # fmt: skip
    return out


@cache
def unified_launch(
    queries_per_kv: int,
    head_dim: int,
    dtype: torch.dtype,
    block_m: int = 64,
    block_n: int | None = None,
    interpret: bool = False,
) -> Launch:
    block_g = triton.next_power_of_2(queries_per_kv)
    block_d = max(16, triton.next_power_of_2(head_dim))
    return Launch(
        {
            "BLOCK_Q": max(1, block_m // block_g), "BLOCK_G": block_g,
            "BLOCK_N": block_n or _default_block_n(block_d), "BLOCK_D": block_d,
            "DOT_PRECISION": _dot_precision(dtype, interpret),
        },
        num_warps=8 if block_d >= 128 else 4,
    )  # fmt: skip


# --------------------------------------------------------------------------- split-KV decode


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale,
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
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_start = split * SPLIT_SIZE
    if kv_start < seq_len:  # splits past this sequence's end belong to longer sequences only
        kv_end = tl.minimum(kv_start + SPLIT_SIZE, seq_len)
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
        m_i, l_i, acc = _attend_tiles(
            q, m_i, l_i, acc, m_i, kv_start, kv_end, k_cache_ptr, v_cache_ptr,
            block_tables_ptr + seq.to(tl.int64) * stride_bt, kv_head, block_size, scale,
            stride_cb, stride_cs, stride_ch, dims, dim_mask,
            CAUSAL=False, BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION,
        )  # fmt: skip
        row = seq.to(tl.int64) * stride_po_t + q_head * stride_po_h + split
        tl.store(part_lse_ptr + row, m_i + tl.log(l_i), mask=head_mask)
        part = acc / l_i[:, None]
        tl.store(
            part_out_ptr + row[:, None] * BLOCK_D + dims[None, :], part, mask=head_mask[:, None]
        )  # padded dims hold zeros


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    out_ptr,
    head_dim,
    stride_po_t,
    stride_po_h,
    stride_ot,
    stride_oh,
    SPLIT_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    n_splits = tl.cdiv(seq_len, SPLIT_SIZE)
    row = seq.to(tl.int64) * stride_po_t + head * stride_po_h
    dims = tl.arange(0, BLOCK_D)
    # Two passes in split order: the merge is a fixed sum whatever the batch looks like.
    max_lse = tl.full([], float("-inf"), tl.float32)
    for s in range(0, n_splits):
        max_lse = tl.maximum(max_lse, tl.load(part_lse_ptr + row + s))
    acc = tl.zeros([BLOCK_D], tl.float32)
    total = tl.zeros([], tl.float32)
    for s in range(0, n_splits):
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
    split_size: int = DEFAULT_SPLIT_SIZE,
    block_n: int | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence (``q`` [B, Hq, D], row i = sequence i) over all
    ``seq_lens[i]`` cached positions (the token's own K/V included), in fixed KV splits.

    ``max_seq_len`` (a host int, >= every ``seq_lens[i]``) sizes the grid; split boundaries are
    multiples of ``split_size`` whatever the batch, and splits merge in order, so each row's
    result is the same run to run and whatever else is in the batch.
    """
    n_q_heads, n_kv_heads, head_dim = _check_shapes(q, k_cache, v_cache)
    num_seqs = q.shape[0]
    if out is None:
        out = torch.empty((num_seqs, n_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_seqs == 0 or max_seq_len <= 0:
        return out
    block_d = max(16, triton.next_power_of_2(head_dim))
    if block_n is None:
        block_n = _default_block_n(block_d)
    if split_size % block_n:
        raise ValueError(f"split_size {split_size} must be a multiple of block_n {block_n}")
    queries_per_kv = n_q_heads // n_kv_heads
    num_splits = triton.cdiv(max_seq_len, split_size)
    part_out = torch.empty((num_seqs, n_q_heads, num_splits, block_d), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((num_seqs, n_q_heads, num_splits), dtype=torch.float32, device=q.device)
    _decode_split_kernel[(num_seqs, n_kv_heads, num_splits)](
        q, k_cache, v_cache, seq_lens, block_tables, part_out, part_lse, scale,
        queries_per_kv, head_dim, k_cache.shape[1], num_splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), part_lse.stride(0), part_lse.stride(1),
        **split_launch(queries_per_kv, head_dim, q.dtype, split_size, block_n, interpreting()).kwargs,
    )  # fmt: skip
    _decode_reduce_kernel[(num_seqs, n_q_heads)](
        part_out, part_lse, seq_lens, out, head_dim,
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
        **reduce_launch(head_dim, split_size).kwargs,
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
) -> Launch:
    return Launch({
        "SPLIT_SIZE": split_size, "BLOCK_H": max(16, triton.next_power_of_2(queries_per_kv)), "BLOCK_N": block_n,
        "BLOCK_D": max(16, triton.next_power_of_2(head_dim)), "DOT_PRECISION": _dot_precision(dtype, interpret),
    })  # fmt: skip


@cache
def reduce_launch(head_dim: int, split_size: int) -> Launch:
    return Launch(
        {"SPLIT_SIZE": split_size, "BLOCK_D": max(16, triton.next_power_of_2(head_dim))}, num_stages=1
    )
