"""Attention in plain PyTorch over the paged KV cache (the CPU backend, also a GPU fallback).

Two numerics, chosen at construction:
* fast (default): decode rows of all sequences in one padded, grouped-query batched matmul;
  prefill chunks one sequence at a time with SDPA.
* deterministic: every query row's result depends only on its own sequence, never on what else
  shares the step, how its prompt was chunked or whether its prefix came from the cache. Keys are
  processed in fixed tiles of ``TILE`` positions, in a fixed order, with matmul shapes that do not
  depend on the batch (rows padded to at least ``MIN_ROWS``: MKL picks a different kernel, with a
  different summation order, for very small M).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, AttentionMetadata

TILE = 32
MIN_ROWS = 16


@dataclass
class _Plan:
    """Per-step index tensors shared by every layer."""

    decode_rows: torch.Tensor | None  # token indices of decode rows (query_len == 1)
    decode_blocks: torch.Tensor | None  # [Bd, nb] block ids
    decode_valid: torch.Tensor | None  # [Bd, 1, 1, L] bool: key position < seq_len
    decode_keep: torch.Tensor | None  # [Bd, 1, 1, L] fp mask (0 / -inf) for the fast path
    prefills: list[tuple[int, int, int, torch.Tensor | None]]  # (start, qlen, ctx, block ids)


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """[nb] or [B, nb] block ids -> [..., nb*block_size, Hkv, D] contiguous copy."""
    g = cache.index_select(0, blocks.reshape(-1))
    return g.reshape(*blocks.shape[:-1], blocks.shape[-1] * cache.shape[1], *cache.shape[2:])


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def _plan(self, meta: AttentionMetadata, device: torch.device) -> _Plan:
        state = meta.backend_state
        if isinstance(state, _Plan):
            return state
        bs = meta.block_size
        dec_idx: list[int] = []
        dec_seq: list[int] = []
        prefills: list[tuple[int, int, int, torch.Tensor | None]] = []
        start = 0
        for i, qlen in enumerate(meta.query_lens_host):
            ctx = meta.context_lens_host[i]
            if qlen == 1 and not self.deterministic:
                dec_idx.append(start)
                dec_seq.append(i)
            else:
                nb = -(-meta.seq_lens_host[i] // bs)
                blocks = None
                if ctx > 0 or self.deterministic:
                    blocks = torch.tensor(meta.block_tables_host[i][:nb], dtype=torch.long, device=device)
                prefills.append((start, qlen, ctx, blocks))
            start += qlen
        plan = _Plan(None, None, None, None, prefills)
        if dec_idx:
            lens = [meta.seq_lens_host[i] for i in dec_seq]
            nb = -(-max(lens) // bs)
            table = [
                meta.block_tables_host[i][:nb] + [0] * (nb - len(meta.block_tables_host[i][:nb]))
                for i in dec_seq
            ]
            plan.decode_rows = torch.tensor(dec_idx, dtype=torch.long, device=device)
            plan.decode_blocks = torch.tensor(table, dtype=torch.long, device=device)
            pos = torch.arange(nb * bs, device=device)
            valid = pos[None, :] < torch.tensor(lens, device=device)[:, None]
            plan.decode_valid = valid[:, None, None, :]
            keep = torch.zeros(valid.shape, dtype=torch.float32, device=device)
            plan.decode_keep = keep.masked_fill_(~valid, float("-inf"))[:, None, None, :]
        meta.backend_state = plan
        return plan

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):  # type: ignore[override]
        hkv, d = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, v)
        plan = self._plan(meta, q.device)
        out = torch.empty_like(q)
        if plan.decode_rows is not None:
            out[plan.decode_rows] = self._decode(
                q.index_select(0, plan.decode_rows), k_cache, v_cache, plan, scale
            )
        attend = self._prefill_det if self.deterministic else self._prefill
        for start, qlen, ctx, blocks in plan.prefills:
            qs = q[start : start + qlen]
            if blocks is None:
                ks, vs = k[start : start + qlen], v[start : start + qlen]
            else:
                ks, vs = _gather(k_cache, blocks), _gather(v_cache, blocks)
            out[start : start + qlen] = attend(qs, ks, vs, ctx, scale)
        return out

    @staticmethod
    def _decode(q: torch.Tensor, k_cache, v_cache, plan: _Plan, scale: float) -> torch.Tensor:
        """All single-token rows at once: [Bd, Hkv, G, D] x [Bd, Hkv, D, L] (no KV head repeat)."""
        bd, hq, d = q.shape
        hkv = k_cache.shape[2]
        kk = _gather(k_cache, plan.decode_blocks).transpose(1, 2)  # [Bd, Hkv, L, D]
        vv = _gather(v_cache, plan.decode_blocks).transpose(1, 2)
        qg = q.view(bd, hkv, hq // hkv, d).float()
        scores = torch.matmul(qg, kk.float().transpose(-1, -2)) * scale + plan.decode_keep
        probs = torch.softmax(scores, dim=-1)
        o = torch.matmul(probs, vv.float())  # [Bd, Hkv, G, D]
        return o.reshape(bd, hq, d).to(q.dtype)

    @staticmethod
    def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: int, scale: float) -> torch.Tensor:
        """One sequence's chunk: queries at positions ctx..ctx+Lq-1 over keys 0..ctx+Lq-1."""
        lq, n = q.shape[0], q.shape[0] + ctx
        qt, kt, vt = q.transpose(0, 1), k[:n].transpose(0, 1), v[:n].transpose(0, 1)
        if ctx == 0:
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
        else:
            mask = torch.ones(lq, n, dtype=torch.bool, device=q.device).tril_(diagonal=ctx)
            o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
        return o.transpose(0, 1)

    @staticmethod
    def _prefill_det(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: int, scale: float
    ) -> torch.Tensor:
        """Batch-invariant attention for one sequence's new rows (decode rows included).

        Row r (position ctx+r) sees keys 0..ctx+r. Scores and the weighted sum run per TILE of keys
        in ascending order; masked keys contribute exact zeros, so neither the number of tiles
        present nor the number of rows alongside changes a row's bits.
        """
        lq, hq, d = q.shape
        hkv = k.shape[1]
        g = hq // hkv
        n = ctx + lq
        ntiles = -(-n // TILE)
        npad = ntiles * TILE
        rows = lq * g
        prow = max(rows, MIN_ROWS)
        qg = torch.zeros(hkv, prow, d, dtype=torch.float32, device=q.device)
        qg[:, :rows] = q.float().reshape(lq, hkv, g, d).permute(1, 0, 2, 3).reshape(hkv, rows, d)
        kf = torch.zeros(hkv, npad, d, dtype=torch.float32, device=q.device)
        vf = torch.zeros(hkv, npad, d, dtype=torch.float32, device=q.device)
        kf[:, :n] = k[:n].float().transpose(0, 1)
        vf[:, :n] = v[:n].float().transpose(0, 1)
        # Last visible key of each (padded) row; padding rows see key 0 only.
        limit = torch.zeros(prow, dtype=torch.long, device=q.device)
        limit[:rows] = torch.arange(ctx, n, device=q.device).repeat_interleave(g)
        key_pos = torch.arange(npad, device=q.device)
        visible = key_pos[None, :] <= limit[:, None]  # [prow, npad]
        scores = torch.empty(hkv, prow, npad, dtype=torch.float32, device=q.device)
        for t in range(ntiles):
            sl = slice(t * TILE, (t + 1) * TILE)
            torch.matmul(qg, kf[:, sl].transpose(-1, -2), out=scores[:, :, sl])
        scores.mul_(scale).masked_fill_(~visible, float("-inf"))
        m = scores.amax(dim=-1, keepdim=True)
        probs = torch.exp(scores - m)
        num = torch.zeros(hkv, prow, d, dtype=torch.float32, device=q.device)
        den = torch.zeros(hkv, prow, 1, dtype=torch.float32, device=q.device)
        for t in range(ntiles):
            sl = slice(t * TILE, (t + 1) * TILE)
            num += torch.matmul(probs[:, :, sl], vf[:, sl])
            den += probs[:, :, sl].sum(dim=-1, keepdim=True)
        o = (num / den)[:, :rows].reshape(hkv, lq, g, d).permute(1, 0, 2, 3).reshape(lq, hq, d)
        return o.to(q.dtype)
