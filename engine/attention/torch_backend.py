"""Attention in plain PyTorch over the paged KV cache (the CPU backend, also a GPU fallback).

Two numerics, chosen at construction:
* fast (default): decode rows batched in a few groups of similar length (padded, grouped-query
  batched matmuls over gathered blocks); prefill chunks one sequence at a time with SDPA.
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
class _DecodeGroup:
    """Single-token rows of sequences with similar lengths, padded to the group's longest."""

    rows: torch.Tensor  # token indices in the flattened batch
    blocks: torch.Tensor  # [Bg, nb] block ids (padded with block 0)
    visible: torch.Tensor  # [Bg, 1, 1, nb*block_size] bool: key position < seq_len
    last_pos: torch.Tensor  # [Bg] position of each row's token (= seq_len - 1)


@dataclass
class _Plan:
    """Per-step index tensors shared by every layer."""

    decode_groups: list[_DecodeGroup]
    prefills: list[tuple[int, int, int, torch.Tensor | None]]  # (start, qlen, ctx, block ids)


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """[nb] or [B, nb] block ids -> [..., nb*block_size, Hkv, D] contiguous copy."""
    g = cache.index_select(0, blocks.reshape(-1))
    return g.reshape(*blocks.shape[:-1], blocks.shape[-1] * cache.shape[1], *cache.shape[2:])


def _split_by_length(seqs: list[int], lens: list[int]) -> list[list[int]]:
    """Sorted by length, cut where padding to the group's longest would waste the most.

    Gathering paged KV costs memory traffic per padded position, so mixed lengths padded to the
    batch maximum can double it; a few groups of similar length keep padding small while each
    group stays one batched matmul.
    """
    order = sorted(range(len(seqs)), key=lambda j: lens[j])
    groups: list[list[int]] = []
    cur: list[int] = []
    for j in order:
        # Start a new group when this sequence is much longer than the group's shortest
        # member and the group is already big enough to be worth its own kernels.
        if cur and len(cur) >= _MIN_GROUP and lens[j] > _GROUP_RATIO * lens[cur[0]]:
            groups.append(cur)
            cur = []
        cur.append(j)
    if cur:
        groups.append(cur)
    return [[seqs[j] for j in g] for g in groups]


_MIN_GROUP = 8
_GROUP_RATIO = 1.5


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def _plan(self, meta: AttentionMetadata, device: torch.device) -> _Plan:
        state = meta.backend_state
        if isinstance(state, _Plan):
            return state
        bs = meta.block_size
        dec_seq: list[int] = []
        starts: list[int] = []
        prefills: list[tuple[int, int, int, torch.Tensor | None]] = []
        start = 0
        for i, qlen in enumerate(meta.query_lens_host):
            ctx = meta.context_lens_host[i]
            starts.append(start)
            if qlen == 1:
                dec_seq.append(i)
            else:
                nb = -(-meta.seq_lens_host[i] // bs)
                blocks = None
                if ctx > 0 or self.deterministic:
                    blocks = torch.tensor(meta.block_tables_host[i][:nb], dtype=torch.long, device=device)
                prefills.append((start, qlen, ctx, blocks))
            start += qlen
        groups = []
        if dec_seq:
            lens_all = meta.seq_lens_host
            for seqs in _split_by_length(dec_seq, [lens_all[i] for i in dec_seq]):
                lens = [lens_all[i] for i in seqs]
                nb = -(-max(lens) // bs)
                tables = [meta.block_tables_host[i][:nb] for i in seqs]
                table = [t + [0] * (nb - len(t)) for t in tables]
                pos = torch.arange(nb * bs, device=device)
                valid = pos[None, :] < torch.tensor(lens, device=device)[:, None]
                groups.append(
                    _DecodeGroup(
                        rows=torch.tensor([starts[i] for i in seqs], dtype=torch.long, device=device),
                        blocks=torch.tensor(table, dtype=torch.long, device=device),
                        visible=valid[:, None, None, :],
                        last_pos=torch.tensor(lens, dtype=torch.long, device=device) - 1,
                    )
                )
        plan = _Plan(groups, prefills)
        meta.backend_state = plan
        return plan

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):  # type: ignore[override]
        hkv, d = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, v)
        plan = self._plan(meta, q.device)
        out = torch.empty_like(q)
        decode = self._decode_det if self.deterministic else self._decode
        for g in plan.decode_groups:
            out.index_copy_(0, g.rows, decode(q.index_select(0, g.rows), k_cache, v_cache, g, scale))
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
    def _decode(q: torch.Tensor, k_cache, v_cache, group: _DecodeGroup, scale: float) -> torch.Tensor:
        """A group's single-token rows in one SDPA call: the G query heads sharing a KV head are
        laid out as G query rows, so KV heads are never repeated."""
        bd, hq, d = q.shape
        hkv = k_cache.shape[2]
        kk = _gather(k_cache, group.blocks).transpose(1, 2)  # [Bg, Hkv, L, D]
        vv = _gather(v_cache, group.blocks).transpose(1, 2)
        qg = q.view(bd, hkv, hq // hkv, d)
        o = F.scaled_dot_product_attention(qg, kk, vv, attn_mask=group.visible, scale=scale)
        return o.reshape(bd, hq, d)

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
        """Batch-invariant attention for one sequence's chunk (see ``_attend_det``)."""
        lq, hq, d = q.shape
        hkv = k.shape[1]
        g = hq // hkv
        n = ctx + lq
        rows = lq * g
        qg = q.reshape(lq, hkv, g, d).permute(1, 0, 2, 3).reshape(1, hkv, rows, d)
        limit = torch.arange(ctx, n, device=q.device).repeat_interleave(g)[None, :]
        o = _attend_det(qg, k[:n].transpose(0, 1)[None], v[:n].transpose(0, 1)[None], limit, n, scale)
        return o[0].reshape(hkv, lq, g, d).permute(1, 0, 2, 3).reshape(lq, hq, d).to(q.dtype)

    @staticmethod
    def _decode_det(q: torch.Tensor, k_cache, v_cache, group: _DecodeGroup, scale: float) -> torch.Tensor:
        """Batch-invariant single-token rows of a group (see ``_attend_det``)."""
        bd, hq, d = q.shape
        hkv = k_cache.shape[2]
        g = hq // hkv
        kk = _gather(k_cache, group.blocks).transpose(1, 2)
        vv = _gather(v_cache, group.blocks).transpose(1, 2)
        limit = group.last_pos[:, None].expand(bd, g)
        o = _attend_det(q.reshape(bd, hkv, g, d), kk, vv, limit, kk.shape[2], scale)
        return o.reshape(bd, hq, d).to(q.dtype)


def _attend_det(
    q: torch.Tensor,  # [S, Hkv, R, D] query rows per KV head
    k: torch.Tensor,  # [S, Hkv, N, D]
    v: torch.Tensor,  # [S, Hkv, N, D]
    limit: torch.Tensor,  # [S, R] last key position each row may see
    n: int,  # keys present (N)
    scale: float,
) -> torch.Tensor:  # [S, Hkv, R, D] fp32
    """Attention whose every row depends only on its own keys, never on S, R or N.

    Keys are processed in tiles of ``TILE`` positions in ascending order; matmuls always have
    at least ``MIN_ROWS`` rows and exactly ``TILE`` keys, so the summation order inside them is
    fixed; keys past a row's limit (and the padding tiles) contribute exact zeros.
    """
    s_, hkv, r, d = q.shape
    dev = q.device
    ntiles = -(-n // TILE)
    npad = ntiles * TILE
    prow = max(r, MIN_ROWS)
    qf = torch.zeros(s_, hkv, prow, d, dtype=torch.float32, device=dev)
    qf[:, :, :r] = q
    kf = torch.zeros(s_, hkv, npad, d, dtype=torch.float32, device=dev)
    vf = torch.zeros(s_, hkv, npad, d, dtype=torch.float32, device=dev)
    kf[:, :, :n] = k[:, :, :n]
    vf[:, :, :n] = v[:, :, :n]
    lim = torch.zeros(s_, prow, dtype=torch.long, device=dev)  # padding rows see key 0 only
    lim[:, :r] = limit
    visible = torch.arange(npad, device=dev)[None, None, :] <= lim[:, :, None]  # [S, prow, npad]
    scores = torch.empty(s_, hkv, prow, npad, dtype=torch.float32, device=dev)
    for t in range(ntiles):
        sl = slice(t * TILE, (t + 1) * TILE)
        scores[..., sl] = torch.matmul(qf, kf[:, :, sl].transpose(-1, -2))
    scores.mul_(scale).masked_fill_(~visible[:, None], float("-inf"))
    probs = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    num = torch.zeros(s_, hkv, prow, d, dtype=torch.float32, device=dev)
    den = torch.zeros(s_, hkv, prow, 1, dtype=torch.float32, device=dev)
    for t in range(ntiles):
        sl = slice(t * TILE, (t + 1) * TILE)
        p = probs[..., sl].contiguous()
        num += torch.matmul(p, vf[:, :, sl])
        den += p.sum(dim=-1, keepdim=True)
    return (num / den)[:, :, :r]
