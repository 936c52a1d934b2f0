"""The stateless tensor functions ``engine/attention/torch_backend.py`` composes: SDPA with what it
lacks (soft-capped scores, attention sinks, fp32 ALiBi biases), reads from the paged KV cache (whole blocks, or the
rows at given slots, widened from fp8 and scaled), and the batch-invariant fixed-tile attention of
deterministic mode. They hold no per-step state and know nothing of plans, windows or batches:
the backend decides what to gather and which of them to call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.base import raw

TILE = 32
MIN_ROWS = 16


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """SDPA over ``[..., L, D]`` with a boolean ``mask`` (True: visible). What SDPA cannot do runs on
    explicit fp32 scores: ``softcap`` soft-caps them first (``softcap * tanh(s / softcap)``, Gemma 2);
    ``bias`` (fp32, broadcastable to the scores: ALiBi's) is added to them (SDPA's float mask would
    round it to the queries' dtype, and a bf16 bias of -50 is off by 0.25); ``sinks`` (fp32,
    broadcastable to the scores' ``[..., 1]``: one logit per query head, gpt-oss) joins each row's
    softmax as one more column that has no value."""
    if softcap is None and sinks is None and bias is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, v.float()).to(q.dtype)


def _gather(
    cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype, scale: float = 1.0
) -> torch.Tensor:
    """[nb] or [B, nb] block ids -> [..., nb*block_size, Hkv, D] contiguous copy in ``dtype`` (an
    fp8 cache's values widened to the queries', times the cache's ``scale``)."""
    g = raw(cache).index_select(0, blocks.reshape(-1)).view(cache.dtype)
    if g.dtype != dtype:
        g = g.to(dtype)
    if scale != 1.0:
        g = g * scale
    return g.reshape(*blocks.shape[:-1], blocks.shape[-1] * cache.shape[1], *cache.shape[2:])


def _read_rows(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """The rows at ``slots`` of a paged cache as attention reads them back: [T, Hkv, D] in ``dtype``
    (an fp8 cache's rounding included), as ``_gather`` widens them."""
    flat = cache.view(-1, *cache.shape[2:])
    g = raw(flat).index_select(0, slots).view(cache.dtype)
    if g.dtype != dtype:
        g = g.to(dtype)
    return g * scale if scale != 1.0 else g


def _attend_det(
    q: torch.Tensor,  # [S, Hkv, R, D] query rows per KV head
    k: torch.Tensor,  # [S, Hkv, N, D]
    v: torch.Tensor,  # [S, Hkv, N, Dv]
    last: torch.Tensor,  # [S, R] last key position each row may see
    first: torch.Tensor | None,  # [S, R] first key position each row may see; None: 0
    n: int,  # keys present (N)
    scale: float,
    softcap: float | None = None,  # scores become softcap * tanh(scores / softcap) (Gemma 2)
    sinks: torch.Tensor | None = None,  # [1 or S, Hkv, R] fp32: each row's sink logit (gpt-oss)
    alibi: torch.Tensor | None = None,  # [1 or S, Hkv, R] fp32: each row's ALiBi slope
) -> torch.Tensor:  # [S, Hkv, R, Dv] fp32
    """Attention whose every row depends only on its own keys, never on S, R or N.

    Keys are processed in tiles of ``TILE`` positions in ascending order; matmuls always have
    at least ``MIN_ROWS`` rows and exactly ``TILE`` keys, so the summation order inside them is
    fixed; keys outside a row's [first, last] (and the padding tiles) contribute exact zeros. Key
    0 must sit at an absolute position that is a multiple of ``TILE``. A row's ``last`` is its own
    query's position (causal), so ALiBi's bias for key ``j`` is ``slope * (j - last)``: positions
    only, never the batch.
    """
    s_, hkv, r, d = q.shape
    dv = v.shape[-1]
    dev = q.device
    ntiles = -(-n // TILE)
    npad = ntiles * TILE
    prow = max(r, MIN_ROWS)
    qf = torch.zeros(s_, hkv, prow, d, dtype=torch.float32, device=dev)
    qf[:, :, :r] = q
    kf = torch.zeros(s_, hkv, npad, d, dtype=torch.float32, device=dev)
    vf = torch.zeros(s_, hkv, npad, dv, dtype=torch.float32, device=dev)
    kf[:, :, :n] = k[:, :, :n]
    vf[:, :, :n] = v[:, :, :n]
    hi = torch.zeros(s_, prow, dtype=torch.long, device=dev)  # padding rows see key 0 only
    hi[:, :r] = last
    key = torch.arange(npad, device=dev)[None, None, :]
    visible = key <= hi[:, :, None]  # [S, prow, npad]
    if first is not None:
        lo = torch.zeros(s_, prow, dtype=torch.long, device=dev)
        lo[:, :r] = first
        visible &= key >= lo[:, :, None]
    scores = torch.empty(s_, hkv, prow, npad, dtype=torch.float32, device=dev)
    for t in range(ntiles):
        sl = slice(t * TILE, (t + 1) * TILE)
        scores[..., sl] = torch.matmul(qf, kf[:, :, sl].transpose(-1, -2))
    scores.mul_(scale)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if alibi is not None:
        slope = torch.zeros(alibi.shape[0], hkv, prow, 1, dtype=torch.float32, device=dev)
        slope[:, :, :r, 0] = alibi
        scores += slope * (key - hi[:, :, None]).float()[:, None]
    scores.masked_fill_(~visible[:, None], float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)
    den = torch.zeros(s_, hkv, prow, 1, dtype=torch.float32, device=dev)
    if sinks is not None:  # one more softmax column per row, with no value: only the denominator
        sink = torch.zeros(sinks.shape[0], hkv, prow, 1, dtype=torch.float32, device=dev)
        sink[:, :, :r, 0] = sinks
        top = torch.maximum(top, sink)
        den = den + torch.exp(sink - top)
    probs = torch.exp(scores - top)
    num = torch.zeros(s_, hkv, prow, dv, dtype=torch.float32, device=dev)
    for t in range(ntiles):
        sl = slice(t * TILE, (t + 1) * TILE)
        p = probs[..., sl].contiguous()
        num += torch.matmul(p, vf[:, :, sl])
        den += p.sum(dim=-1, keepdim=True)
    return (num / den)[:, :, :r]
