"""Paged attention in Triton over ferry's KV-cache layout.

``unified_attention`` reads K/V through the block table from caches shaped
``[num_blocks, block_size, num_kv_heads, head_dim]`` (slot = block_id * block_size + offset), in
one launch for a whole mixed batch. Each sequence contributes ``q_len`` new tokens (prefill
chunk, prefix-hit tail, or a single decode token); every new token attends causally to its
sequence's cached prefix plus the new tokens up to itself, or, with a sliding ``window``, to the
positions k with ``q_pos - window < k <= q_pos``, and with an attention ``chunk`` (Llama 4) only to
the keys of its own chunk (``k // chunk == q_pos // chunk``). With ALiBi slopes (Bloom, MPT), head
h's scaled score gets ``slope[h] * (k - q_pos)`` added in fp32: a bias of positions only, so it is
the same whatever the batch or the prompt's chunking. The online-softmax tile loop
(``attend_tiles``) is shared with the split-KV decode kernel in ``triton_decode.py``.

Numerics: Q/K/V are converted to fp32 right after loading and the online softmax runs in fp32.
An fp8 cache's scales (``k_scale`` / ``v_scale``: the cache holds K / k_scale) are applied outside
the tile loop: ``k_scale`` joins the softmax scale and ``v_scale`` multiplies each row's output, so
the loop reads fp8 values widened as they are (with scales of 1.0 both are exact no-ops).
fp32 models use exact fp32 dots; fp16/bf16 models on a GPU use tf32 dots, which hold fp16 and
bf16 values exactly, so only the probabilities are rounded (to tf32) before the P@V product.

Batch invariance (``--deterministic``): tile shapes depend on head counts, head dim and dtype,
never on the batch; KV tiles always start at position 0 (or at a split boundary; with a window,
at the first tile the query tile's window or chunk reaches, which depends only on the query tile's
absolute position), and tiles a row does not need are exact no-ops for it. So a token's output
does not depend on which other tokens or sequences share its launch, nor on how its own prompt
was chunked. The split-KV decode kernel is a different summation, so a backend wanting that
guarantee must not switch between the two per batch.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from engine.kernels import Launch, interpreting


def dot_precision(dtype: torch.dtype, interpret: bool) -> str:
    if dtype == torch.float32 or interpret:
        return "ieee"
    return "tf32"


def default_block_n(block_d: int) -> int:
    return 64 if block_d <= 64 else 32


# The window argument the kernels get for full attention: wider than any sequence.
FULL_WINDOW = 1 << 30


def kernel_window(window: int | None) -> int:
    """The kernels' ``window`` argument for a layer's window (None: full attention)."""
    if window is not None and window < 1:
        raise ValueError(f"a sliding window must be at least 1 token, got {window}")
    return FULL_WINDOW if window is None else window


def kernel_chunk(chunk: int | None) -> int:
    """The kernels' ``chunk`` argument for a layer's attention chunk (None: one chunk holds all)."""
    if chunk is not None and chunk < 1:
        raise ValueError(f"an attention chunk must be at least 1 token, got {chunk}")
    return FULL_WINDOW if chunk is None else chunk


def check_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
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
def attend_tiles(
    q,
    m_i,
    l_i,
    acc,
    q_pos,
    q_first,
    slope,
    kv_start,
    kv_end,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    kv_head,
    block_size,
    scale,
    softcap,
    stride_cb,
    stride_cs,
    stride_ch,
    dims,
    dim_mask,
    CAUSAL: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online-softmax accumulation of K/V positions [kv_start, kv_end) into (m_i, l_i, acc).

    With ``CAUSAL``, row r sees positions ``q_first[r] <= pos <= q_pos[r]``; otherwise all of them.
    With ``SOFTCAP``, scaled scores become ``softcap * tanh(score / softcap)`` (Gemma 2). With
    ``ALIBI``, row r's score for position ``pos`` gets ``slope[r] * (pos - q_pos[r])`` added.
    """
    for tile_start in range(kv_start, kv_end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        pos_mask = pos < kv_end
        block_ids = tl.load(block_table_ptr + pos // block_size, mask=pos_mask, other=0).to(tl.int64)
        kv_offs = block_ids * stride_cb + (pos % block_size) * stride_cs + kv_head * stride_ch
        kv_mask = pos_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offs[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        if SOFTCAP:  # tanh(x) = 2 * sigmoid(2x) - 1
            scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0)
        if ALIBI:
            scores += slope[:, None] * (pos[None, :] - q_pos[:, None]).to(tl.float32)
        if CAUSAL:
            visible = (
                pos_mask[None, :] & (pos[None, :] <= q_pos[:, None]) & (pos[None, :] >= q_first[:, None])
            )
        else:
            visible = pos_mask[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        # A row that has seen nothing yet (m_new still -inf: its window starts in a later tile)
        # subtracts 0 instead, keeping l = 0 and acc = 0 exact. Once a row has seen a key, a tile
        # with nothing visible leaves (m, l, acc) bit-for-bit unchanged (alpha == 1, p == 0).
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_sub)
        p = tl.exp(scores - m_sub[:, None])
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
    sinks_ptr,
    alibi_ptr,
    scale,
    v_scale,
    softcap,
    window,
    chunk,
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
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
    ALIBI: tl.constexpr,
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
        # Start at the tile holding the first key the tile's lowest row sees: the same tile for
        # a given position however the batch or the prompt's chunks are laid out.
        low = pos_block * BLOCK_Q
        kv_start = tl.maximum(tl.maximum(low - window + 1, low // chunk * chunk), 0) // BLOCK_N * BLOCK_N
        q_first = tl.maximum(q_pos - window + 1, q_pos // chunk * chunk)
        slope = l_i  # unread without ALIBI
        if ALIBI:
            slope = tl.load(alibi_ptr + q_head, mask=row_mask, other=0.0).to(tl.float32)
        m_i, l_i, acc = attend_tiles(
            q, m_i, l_i, acc, q_pos, q_first, slope, kv_start, kv_end, k_cache_ptr, v_cache_ptr,
            block_tables_ptr + seq.to(tl.int64) * stride_bt, kv_head, block_size, scale, softcap,
            stride_cb, stride_cs, stride_ch, dims, dim_mask,
            CAUSAL=True, SOFTCAP=SOFTCAP, ALIBI=ALIBI, BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION,
        )  # fmt: skip
        if SINKS:  # one more softmax column per query head, with no value (gpt-oss)
            sink = tl.load(sinks_ptr + q_head, mask=row_mask, other=0.0).to(tl.float32)
            m_new = tl.maximum(m_i, sink)
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.exp(sink - m_new)
            acc = acc * alpha[:, None]
        out = acc * v_scale / tl.where(row_mask, l_i, 1.0)[:, None]
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
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    chunk: int | None = None,
    alibi: torch.Tensor | None = None,
    block_m: int = 64,
    block_n: int | None = None,
) -> torch.Tensor:
    """Causal attention of the new tokens ``q`` [T, Hq, D] of a batch of sequences, within a
    sliding ``window`` if one is given, within each query's attention ``chunk`` if one is given,
    scores soft-capped at ``softcap`` if one is given, plus ``alibi[h] * (k_pos - q_pos)`` if ALiBi
    slopes (fp32 [Hq]) are given, with a value-less softmax column of ``sinks[h]`` (fp32 [Hq]) per
    query head if they are given.

    Sequence ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]`` (possibly none),
    has ``seq_lens[i]`` tokens in total after this step (its K/V already in the caches) and
    its blocks listed in ``block_tables[i]``. The caches' values are read times ``k_scale`` /
    ``v_scale`` (an fp8 cache's scales). ``block_m`` (query rows x grouped heads per tile)
    and ``block_n`` (KV positions per tile) are powers of two and fix the numerics: keep them
    constant across steps for batch invariance.
    """
    n_q_heads, n_kv_heads, head_dim = check_shapes(q, k_cache, v_cache)
    n_tokens = q.shape[0]
    if out is None:
        out = torch.empty((n_tokens, n_q_heads, head_dim), dtype=q.dtype, device=q.device)
    num_seqs = seq_lens.shape[0]
    if n_tokens == 0 or num_seqs == 0:
        return out
    queries_per_kv = n_q_heads // n_kv_heads
    launch = unified_launch(
        queries_per_kv, head_dim, q.dtype, block_m, block_n, interpreting(), softcap is not None,
        sinks is not None, alibi is not None,
    )  # fmt: skip
    grid = (n_tokens // launch["BLOCK_Q"] + 2 * num_seqs, n_kv_heads)
    _unified_attention_kernel[grid](
        q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables,
        q if sinks is None else sinks, q if alibi is None else alibi, scale * k_scale, v_scale, softcap or 0.0,
        kernel_window(window), kernel_chunk(chunk),
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
    softcap: bool = False,
    sinks: bool = False,
    alibi: bool = False,
) -> Launch:
    block_g = triton.next_power_of_2(queries_per_kv)
    block_d = max(16, triton.next_power_of_2(head_dim))
    return Launch(
        {
            "BLOCK_Q": max(1, block_m // block_g), "BLOCK_G": block_g,
            "BLOCK_N": block_n or default_block_n(block_d), "BLOCK_D": block_d,
            "DOT_PRECISION": dot_precision(dtype, interpret), "SOFTCAP": softcap,
            "SINKS": sinks, "ALIBI": alibi,
        },
        num_warps=8 if block_d >= 128 else 4,
    )  # fmt: skip
