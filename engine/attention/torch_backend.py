"""Attention in plain PyTorch over the paged KV cache (the CPU backend, also a GPU fallback).

Two numerics, chosen at construction:
* fast (default): decode rows batched in a few groups of similar length (padded, grouped-query
  batched matmuls over gathered blocks); prefill chunks one sequence at a time with SDPA.
* deterministic: every query row's result depends only on its own sequence, never on what else
  shares the step, how its prompt was chunked or whether its prefix came from the cache. Keys are
  processed in fixed tiles of ``TILE`` positions, in a fixed order, with matmul shapes that do not
  depend on the batch (rows padded to at least ``MIN_ROWS``: MKL picks a different kernel, with a
  different summation order, for very small M).

A sliding-window layer gathers only the blocks its window reaches (a chunked layer, Llama 4's, only
those of its query's chunk: the same code with another first visible key, ``lowest_key``). In
deterministic mode the gathered keys start at a multiple of ``TILE`` (and of the block size), so tiles
still sit at the same absolute positions and the tiles left out would only have added exact zeros.

Soft-capped scores (Gemma 2), attention sinks (gpt-oss) and ALiBi biases (Bloom, MPT) take explicit
fp32 scores in the fast path (SDPA has neither, and its float mask would round a bias to the queries'
dtype); layers without them keep SDPA. ALiBi's bias ``slope * (k_pos - q_pos)`` depends on absolute
positions only, so prefix hits and chunked prefill see the same bias as one whole prefill.

This file dispatches; each step's plan (which rows batch together, which blocks each window reaches)
is ``engine/attention/torch_plan.py``'s, and the tensor functions it calls, the fixed-tile
deterministic attention among them, are ``engine/attention/torch_ops.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, AttentionMetadata, store_rows
from engine.attention.torch_ops import _attend_det, _gather, _read_rows, _sdpa
from engine.attention.torch_plan import DecodeKeys, Prefill, step_plan, window_plan


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(  # type: ignore[override]
        self,
        q,
        k,
        v,
        k_cache,
        v_cache,
        meta,
        scale,
        window=None,
        softcap=None,
        sinks=None,
        k_scale=1.0,
        v_scale=1.0,
        chunk=None,
        alibi=None,
    ):
        store_rows(k_cache, meta.slot_mapping, k, k_scale)
        store_rows(v_cache, meta.slot_mapping, v, v_scale)
        scales = (k_scale, v_scale)
        return self._attend(
            q, k, v, k_cache, v_cache, meta, scale, window, softcap, sinks, scales, chunk, alibi
        )

    def forward_mla(self, q, kv, kv_cache, meta, scale, v_dim, kv_scale=1.0):  # type: ignore[override]
        store_rows(kv_cache, meta.slot_mapping, kv.view(-1, 1, kv_cache.shape[3]), kv_scale)
        return self._attend(
            q, kv, kv[..., :v_dim], kv_cache, None, meta, scale, None, scales=(kv_scale, kv_scale)
        )

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor | None,  # None: values are the first v.shape[-1] dims of the keys (MLA)
        meta: AttentionMetadata,
        scale: float,
        window: int | None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        scales: tuple[float, float] = (1.0, 1.0),  # what the caches' values are multiplied by when read
        chunk: int | None = None,
        alibi: torch.Tensor | None = None,  # [Hq] fp32 slopes
    ) -> torch.Tensor:
        plan = step_plan(meta, q.device)
        wplan = plan.windows.get((window, chunk))
        if wplan is None:
            wplan = plan.windows[window, chunk] = window_plan(
                plan, meta, q.device, window, chunk, self.deterministic
            )
        dv = v.shape[-1]
        out = q.new_empty((*q.shape[:2], dv))
        decode = self._decode_det if self.deterministic else self._decode
        k_scale, v_scale = scales
        for g, keys in zip(plan.decode_groups, wplan.decode_keys, strict=True):
            kk = _gather(k_cache, keys.blocks, q.dtype, k_scale)  # [Bg, L, Hkv, D]
            vv = kk[..., :dv] if v_cache is None else _gather(v_cache, keys.blocks, q.dtype, v_scale)
            out.index_copy_(
                0, g.rows, decode(q.index_select(0, g.rows), kk, vv, keys, scale, softcap, sinks, alibi)
            )
        attend = self._prefill_det if self.deterministic else self._prefill
        # A cache that rounds what it stores (fp8, or scaled): every read, a first chunk's included,
        # sees the stored values, so a prompt's tokens do not depend on how it was chunked, cached
        # or batched (later chunks, prefix hits and decode read the rounded values back).
        rounded = k_cache.dtype != q.dtype or scales != (1.0, 1.0)
        for p in wplan.prefills:
            qs = q[p.start : p.start + p.qlen]
            if p.blocks is None and rounded:  # a first chunk: its keys start at position 0
                slots = meta.slot_mapping[p.start : p.start + p.qlen]
                ks = _read_rows(k_cache, slots, q.dtype, k_scale).view(k[p.start : p.start + p.qlen].shape)
                vs = ks[..., :dv] if v_cache is None else _read_rows(v_cache, slots, q.dtype, v_scale)
            elif p.blocks is None:
                ks, vs = k[p.start : p.start + p.qlen], v[p.start : p.start + p.qlen]
            else:
                ks = _gather(k_cache, p.blocks, q.dtype, k_scale)
                vs = ks[..., :dv] if v_cache is None else _gather(v_cache, p.blocks, q.dtype, v_scale)
            out[p.start : p.start + p.qlen] = attend(
                qs, ks, vs, p, window, chunk, scale, softcap, sinks, alibi
            )
        return out

    @staticmethod
    def _decode(
        q: torch.Tensor,
        kk: torch.Tensor,
        vv: torch.Tensor,
        keys: DecodeKeys,
        scale: float,
        softcap: float | None,
        sinks: torch.Tensor | None = None,
        alibi: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A group's single-token rows in one SDPA call over its gathered keys/values
        ``[Bg, L, Hkv, D]``: the G query heads sharing a KV head are laid out as G query rows, so
        KV heads are never repeated."""
        bd, hq, d = q.shape
        hkv = kk.shape[2]
        qg = q.view(bd, hkv, hq // hkv, d)
        sink = None if sinks is None else sinks.view(hkv, hq // hkv, 1)
        bias = None
        if alibi is not None:  # key j of row b sits j - last[b] positions from its query
            rel = torch.arange(kk.shape[1], device=q.device)[None, :] - keys.last[:, None]
            bias = alibi.view(1, hkv, hq // hkv, 1) * rel.float()[:, None, None, :]
        o = _sdpa(qg, kk.transpose(1, 2), vv.transpose(1, 2), keys.visible, scale, softcap, sink, bias)
        return o.reshape(bd, hq, vv.shape[-1])

    @staticmethod
    def _prefill(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        p: Prefill,
        window: int | None,
        chunk: int | None,
        scale: float,
        softcap: float | None,
        sinks: torch.Tensor | None = None,
        alibi: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One sequence's chunk over keys ``p.first_key .. ctx+Lq-1`` (``k`` may run past them);
        the window and the attention chunk are already in ``p.mask``."""
        nk = p.ctx + p.qlen - p.first_key
        # 4-D [1, H, L, D]: with 3-D inputs PyTorch's CPU SDPA takes its unfused math path, which
        # measured 4-9x slower here than the flash kernel 4-D inputs get (fp32 and bf16).
        qt, kt, vt = q.transpose(0, 1)[None], k[:nk].transpose(0, 1)[None], v[:nk].transpose(0, 1)[None]
        if softcap is not None or sinks is not None or alibi is not None:
            mask = p.mask
            if mask is None:  # plain causal over keys from position 0: square
                mask = torch.ones(p.qlen, nk, dtype=torch.bool, device=q.device).tril_()
            bias = None
            if alibi is not None:  # key j sits at position first_key + j, query i at ctx + i
                dev = q.device
                rel = (
                    torch.arange(p.first_key, p.first_key + nk, device=dev)[None, :]
                    - torch.arange(p.ctx, p.ctx + p.qlen, device=dev)[:, None]
                )
                bias = alibi.view(-1, 1, 1) * rel.float()
            rep = q.shape[1] // k.shape[1]
            kt, vt = kt.repeat_interleave(rep, 1), vt.repeat_interleave(rep, 1)
            sink = None if sinks is None else sinks.view(-1, 1, 1)
            o = _sdpa(qt, kt, vt, mask, scale, softcap, sink, bias)
        elif p.mask is None:
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=p.mask, scale=scale, enable_gqa=True)
        return o[0].transpose(0, 1)

    @staticmethod
    def _prefill_det(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        p: Prefill,
        window: int | None,
        chunk: int | None,
        scale: float,
        softcap: float | None,
        sinks: torch.Tensor | None = None,
        alibi: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Batch-invariant attention for one sequence's chunk (see ``_attend_det``)."""
        lq, hq, d = q.shape
        hkv = k.shape[1]
        g = hq // hkv
        # Row r of KV head h is query token r // g, head h * g + r % g.
        sink = (
            None if sinks is None else sinks.view(1, hkv, 1, g).expand(1, hkv, lq, g).reshape(1, hkv, lq * g)
        )
        nk = p.ctx + lq - p.first_key
        rows = lq * g
        qg = q.reshape(lq, hkv, g, d).permute(1, 0, 2, 3).reshape(1, hkv, rows, d)
        q_pos = torch.arange(p.ctx, p.ctx + lq, device=q.device).repeat_interleave(g)[None, :]
        last = q_pos - p.first_key
        first = None
        if window is not None or chunk is not None:
            low = torch.zeros_like(q_pos) if chunk is None else q_pos // chunk * chunk
            if window is not None:
                low = torch.maximum(low, q_pos - window + 1)
            first = low.clamp_(min=p.first_key) - p.first_key
        kk, vv = k[:nk].transpose(0, 1)[None], v[:nk].transpose(0, 1)[None]
        slope = None
        if alibi is not None:
            slope = alibi.view(1, hkv, 1, g).expand(1, hkv, lq, g).reshape(1, hkv, lq * g)
        o = _attend_det(qg, kk, vv, last, first, nk, scale, softcap, sink, slope)
        dv = v.shape[-1]
        return o[0].reshape(hkv, lq, g, dv).permute(1, 0, 2, 3).reshape(lq, hq, dv).to(q.dtype)

    @staticmethod
    def _decode_det(
        q: torch.Tensor,
        kk: torch.Tensor,
        vv: torch.Tensor,
        keys: DecodeKeys,
        scale: float,
        softcap: float | None,
        sinks: torch.Tensor | None = None,
        alibi: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Batch-invariant single-token rows of a group (see ``_attend_det``)."""
        bd, hq, d = q.shape
        hkv = kk.shape[2]
        g = hq // hkv
        kk, vv = kk.transpose(1, 2), vv.transpose(1, 2)
        last = keys.last[:, None].expand(bd, g)
        first = None if keys.first is None else keys.first[:, None].expand(bd, g)
        sink = None if sinks is None else sinks.view(1, hkv, g)
        slope = None if alibi is None else alibi.view(1, hkv, g)
        qg = q.reshape(bd, hkv, g, d)
        o = _attend_det(qg, kk, vv, last, first, kk.shape[2], scale, softcap, sink, slope)
        return o.reshape(bd, hq, vv.shape[-1]).to(q.dtype)
