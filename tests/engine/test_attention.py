"""Torch attention backend against a naive dense reference, on a paged cache with scattered blocks."""

from __future__ import annotations

import pytest
import torch

from engine.attention import AttentionMetadata, get_attention_backend, resolve_backend_name

BS, HQ, HKV, D = 4, 4, 2, 8


def _meta(seqs: list[tuple[int, int]], tables: list[list[int]]) -> AttentionMetadata:
    """seqs: (context_len, query_len) per sequence."""
    return AttentionMetadata.for_chunks(seqs, tables, BS)


def _reference(q_all, k_all, v_all, ctx, scale):
    """Dense causal attention for the last q rows over all keys (keys repeated per GQA group)."""
    n = k_all.shape[0]
    lq = q_all.shape[0]
    k = k_all.repeat_interleave(HQ // HKV, dim=1)
    v = v_all.repeat_interleave(HQ // HKV, dim=1)
    s = torch.einsum("qhd,khd->hqk", q_all, k) * scale
    mask = torch.arange(n)[None, :] <= (torch.arange(lq) + ctx)[:, None]
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


@pytest.mark.parametrize("deterministic", [False, True])
def test_torch_backend_matches_dense_reference(deterministic: bool) -> None:
    torch.manual_seed(0)
    backend = get_attention_backend("torch", "cpu", deterministic=deterministic)
    num_blocks = 40
    k_cache = torch.zeros(num_blocks, BS, HKV, D)
    v_cache = torch.zeros(num_blocks, BS, HKV, D)
    # Three sequences: a fresh prefill, a chunk after a cached prefix, a decode step.
    seqs = [(0, 7), (5, 6), (9, 1)]
    tables = [[3, 17], [8, 2, 30], [11, 5, 21]]
    full_k = [torch.randn(c + q, HKV, D) for c, q in seqs]
    full_v = [torch.randn(c + q, HKV, D) for c, q in seqs]
    full_q = [torch.randn(q, HQ, D) for _, q in seqs]
    for (ctx, _), table, kk, vv in zip(seqs, tables, full_k, full_v, strict=True):
        for p in range(ctx):  # the cached prefix is already in the cache
            k_cache[table[p // BS], p % BS] = kk[p]
            v_cache[table[p // BS], p % BS] = vv[p]
    meta = _meta(seqs, tables)
    q = torch.cat(full_q)
    k = torch.cat([kk[c:] for (c, _), kk in zip(seqs, full_k, strict=True)])
    v = torch.cat([vv[c:] for (c, _), vv in zip(seqs, full_v, strict=True)])
    out = backend.forward(q, k, v, k_cache, v_cache, meta, 0.35)
    start = 0
    for (ctx, qlen), qq, kk, vv, table in zip(seqs, full_q, full_k, full_v, tables, strict=True):
        ref = _reference(qq, kk, vv, ctx, 0.35)
        torch.testing.assert_close(out[start : start + qlen], ref, atol=1e-5, rtol=1e-5)
        for p in range(ctx, ctx + qlen):  # new keys landed in their slots
            assert torch.equal(k_cache[table[p // BS], p % BS], kk[p])
            assert torch.equal(v_cache[table[p // BS], p % BS], vv[p])
        start += qlen


def test_registry_resolves_auto_and_rejects_unknown() -> None:
    assert resolve_backend_name("auto", "cpu") == "torch"
    assert resolve_backend_name("auto", "cuda:0") == "triton"
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        resolve_backend_name("nope", "cpu")


def test_many_decode_rows_of_mixed_lengths_match_reference() -> None:
    """Decode rows are grouped by length internally; every row must still match."""
    torch.manual_seed(1)
    backend = get_attention_backend("torch", "cpu")
    lens = [1, 3, 4, 5, 9, 17, 20, 22, 30, 31, 33, 40, 41, 60, 61, 62, 80, 90, 120, 121]
    num_blocks = sum(-(-n // BS) for n in lens) + 3
    perm = torch.randperm(num_blocks).tolist()
    k_cache = torch.zeros(num_blocks, BS, HKV, D)
    v_cache = torch.zeros(num_blocks, BS, HKV, D)
    seqs, tables, ks, vs, qs = [], [], [], [], []
    for n in lens:
        nb = -(-n // BS)
        tables.append([perm.pop() for _ in range(nb)])
        seqs.append((n - 1, 1))
        ks.append(torch.randn(n, HKV, D))
        vs.append(torch.randn(n, HKV, D))
        qs.append(torch.randn(1, HQ, D))
        for p in range(n - 1):
            k_cache[tables[-1][p // BS], p % BS] = ks[-1][p]
            v_cache[tables[-1][p // BS], p % BS] = vs[-1][p]
    meta = _meta(seqs, tables)
    out = backend.forward(
        torch.cat(qs),
        torch.stack([kk[-1] for kk in ks]),
        torch.stack([vv[-1] for vv in vs]),
        k_cache,
        v_cache,
        meta,
        0.3,
    )
    assert len(meta.backend_state.decode_groups) > 1
    for i, n in enumerate(lens):
        ref = _reference(qs[i], ks[i], vs[i], n - 1, 0.3)
        torch.testing.assert_close(out[i : i + 1], ref, atol=1e-5, rtol=1e-5)
