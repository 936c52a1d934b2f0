"""The float64 reference the attention-backend tests (sliding windows, chunked attention, ALiBi)
compare against: K/V gathered position by position from the paged cache, masked as transformers
masks, with Bloom's ALiBi bias (``slope * key position``; the softmax drops the per-row shift)."""

from __future__ import annotations

import torch

from engine.attention.base import AttentionMetadata


def reference_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    chunk: int | None = None,
    slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    bs, hq, hkv = meta.block_size, q.shape[1], k_cache.shape[2]
    q, k_cache, v_cache = q.cpu(), k_cache.cpu(), v_cache.cpu()
    outs = []
    for i, (ctx, n) in enumerate(zip(meta.context_lens_host, meta.query_lens_host, strict=True)):
        pos = torch.arange(ctx + n)
        blocks = torch.tensor(meta.block_tables_host[i], dtype=torch.long)[pos // bs]
        k = k_cache[blocks, pos % bs].double().repeat_interleave(hq // hkv, dim=1)
        v = v_cache[blocks, pos % bs].double().repeat_interleave(hq // hkv, dim=1)
        start = int(meta.query_start_loc[i])
        q_pos = torch.arange(ctx, ctx + n)[:, None]
        visible = pos[None, :] <= q_pos
        if window is not None:
            visible &= pos[None, :] > q_pos - window
        if chunk is not None:
            visible &= pos[None, :] // chunk == q_pos // chunk
        scores = torch.einsum("thd,shd->hts", q[start : start + n].double(), k) * scale
        if slopes is not None:
            scores = scores + slopes.cpu().double()[:, None, None] * pos.double()[None, None, :]
        probs = scores.masked_fill(~visible[None], float("-inf")).softmax(-1)
        outs.append(torch.einsum("hts,shd->thd", probs, v))
    return torch.cat(outs)


def max_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.double().cpu() - ref).abs().max().item()
