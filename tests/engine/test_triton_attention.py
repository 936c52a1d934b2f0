"""Triton paged attention (engine/kernels/triton_attention.py, triton_decode.py) and the Triton backend.

Each kernel runs against a float64 PyTorch reference that gathers K/V through the block table;
the batch-invariance and determinism promises are checked bit for bit. Without a GPU the kernels
run under Triton's interpreter, so sizes stay small.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():  # never force the interpreter onto a real GPU run
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton", reason="triton is not installed (pip install 'ferry-serve[triton]')")

from engine.attention.base import AttentionMetadata  # noqa: E402
from engine.attention.registry import get_attention_backend  # noqa: E402
from engine.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from engine.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from engine.kernels.triton_attention import unified_attention  # noqa: E402
from engine.kernels.triton_decode import split_kv_decode_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bf16 outputs are one rounding of an fp32 result: at most one bf16 ulp (the interpreter truncates).
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()  # the reference is computed on the CPU
    return float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


@dataclass
class Batch:
    """A paged batch: caches already holding every sequence's K/V, plus the new-token queries."""

    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata
    context_lens: list[int]
    query_lens: list[int]


def make_batch(
    seqs: list[tuple[int, int]],
    *,
    hkv: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    block_size: int = 16,
    seed: int = 0,
    num_blocks: int | None = None,
) -> Batch:
    """``seqs`` = [(context_len, query_len)]; blocks are scattered through the cache at random and
    unused slots hold random values, so a kernel reading a wrong slot cannot go unnoticed."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // block_size) for c, n in seqs]
    num_blocks = num_blocks or sum(need) + 3
    k_cache = torch.randn(num_blocks, block_size, hkv, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, head_dim, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(max(need, default=1), 1) + 2  # padded with 0, as the runner pads
    tables, used = [], 0
    for n in need:
        tables.append(perm[used : used + n] + [0] * (width - n))
        used += n
    query_lens = [n for _, n in seqs]
    q = torch.randn(sum(query_lens), hkv * group, head_dim, generator=gen).to(dtype)
    meta = AttentionMetadata.for_chunks(seqs, tables, block_size, DEVICE)
    return Batch(q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), meta, [c for c, _ in seqs], query_lens)


def reference(batch: Batch, scale: float, softcap: float | None = None) -> torch.Tensor:
    """Causal attention in float64 over K/V gathered position by position through the block table
    (scores soft-capped at ``softcap`` when given)."""
    meta, bs = batch.meta, batch.meta.block_size
    hq, hkv = batch.q.shape[1], batch.k_cache.shape[2]
    outs = []
    for i, (ctx, n) in enumerate(zip(batch.context_lens, batch.query_lens, strict=True)):
        if n == 0:
            continue
        pos = torch.arange(ctx + n)
        blocks = torch.tensor(meta.block_tables_host[i], dtype=torch.long)[pos // bs]
        k = batch.k_cache.cpu()[blocks, pos % bs].double().repeat_interleave(hq // hkv, dim=1)
        v = batch.v_cache.cpu()[blocks, pos % bs].double().repeat_interleave(hq // hkv, dim=1)
        start = meta.query_start_loc[i].item()
        q = batch.q.cpu()[start : start + n].double()
        scores = torch.einsum("thd,shd->hts", q, k) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        hidden = pos[None, None, :] > torch.arange(ctx, ctx + n)[None, :, None]
        probs = scores.masked_fill(hidden, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hts,shd->thd", probs, v))
    if not outs:
        return torch.empty(0, hq, batch.q.shape[2], dtype=torch.float64)
    return torch.cat(outs)


def run_unified(batch: Batch, scale: float, **kw) -> torch.Tensor:
    m = batch.meta
    return unified_attention(
        batch.q, batch.k_cache, batch.v_cache, m.query_start_loc, m.seq_lens, m.block_tables, scale, **kw
    )


# Prefill of exactly a block, block+1 and block-1; decode at block boundaries; a single-token
# sequence; an empty one (no new tokens this step); chunked prefills crossing blocks.
MIXED = [(0, 16), (0, 17), (15, 1), (16, 1), (0, 1), (5, 0), (31, 3), (40, 9), (0, 15), (17, 1)]


@pytest.mark.parametrize(
    "group,head_dim,dtype,block_size,block_n",
    [
        (1, 16, torch.float32, 16, None),
        (2, 40, torch.float16, 16, 16),
        (4, 24, torch.bfloat16, 16, None),
        (4, 128, torch.float32, 8, 16),
        (2, 80, torch.float32, 5, 32),
        (1, 64, torch.float16, 16, 32),
    ],
)
def test_unified_attention_matches_reference(group, head_dim, dtype, block_size, block_n) -> None:
    batch = make_batch(MIXED, hkv=2, group=group, head_dim=head_dim, dtype=dtype, block_size=block_size)
    scale = head_dim**-0.5
    out = run_unified(batch, scale, block_n=block_n)
    assert out.shape == batch.q.shape and out.dtype == dtype
    assert rel_err(out, reference(batch, scale)) < TOL[dtype]


def test_unified_attention_long_prefill_many_tiles() -> None:
    batch = make_batch([(0, 150), (70, 60)], hkv=1, group=2, head_dim=32, dtype=torch.float32, seed=3)
    out = run_unified(batch, 0.2)
    assert rel_err(out, reference(batch, 0.2)) < 1e-5


def test_soft_capped_scores_in_both_kernels() -> None:
    """Gemma 2's cap: scores become cap * tanh(score / cap); a small cap makes it matter."""
    batch = make_batch(MIXED, hkv=2, group=2, head_dim=32, dtype=torch.float32, seed=5)
    want = reference(batch, 0.5, softcap=1.5)
    assert rel_err(run_unified(batch, 0.5, softcap=1.5), want) < 1e-5
    assert rel_err(run_unified(batch, 0.5), want) > 1e-2  # the cap changed the result
    decode = decode_batch([1, 17, 70, 130], hkv=2, group=2, head_dim=32, dtype=torch.float32, seed=6)
    out = run_split(decode, 0.5, softcap=1.5, split_size=64)
    assert rel_err(out, reference(decode, 0.5, softcap=1.5)) < 1e-5


def test_unified_attention_empty_inputs() -> None:
    batch = make_batch([(4, 0), (0, 0)], hkv=2, group=2, head_dim=16, dtype=torch.float32)
    assert run_unified(batch, 1.0).shape == (0, 4, 16)
    q = torch.zeros(0, 4, 16, device=DEVICE)
    empty_meta = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    out = unified_attention(
        q, batch.k_cache, batch.v_cache, empty_meta, empty_meta[:0], batch.meta.block_tables[:0], 1.0
    )
    assert out.shape == (0, 4, 16)


def test_unified_attention_rejects_mismatched_heads() -> None:
    batch = make_batch([(0, 3)], hkv=2, group=2, head_dim=16, dtype=torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        unified_attention(batch.q[:, :3], batch.k_cache, batch.v_cache, batch.meta.query_start_loc,
                          batch.meta.seq_lens, batch.meta.block_tables, 1.0)  # fmt: skip


def test_unified_attention_is_chunking_and_batch_invariant() -> None:
    """A prompt's rows are bit-identical whether it is prefilled at once, in chunks, after a
    prefix hit, or beside other sequences (the --deterministic promise)."""
    prompt, cfg = 45, dict(hkv=2, group=2, head_dim=32, dtype=torch.float32, seed=7)
    alone = make_batch([(0, prompt)], **cfg)
    full = run_unified(alone, 0.25)

    def rows_when(seqs: list[tuple[int, int]], which: int) -> torch.Tensor:
        # Same caches and block table for our sequence (seed fixed, placed first), other rows differ.
        b = make_batch(seqs, **cfg)
        b.k_cache, b.v_cache = alone.k_cache, alone.v_cache
        b.meta.block_tables[which] = alone.meta.block_tables[0][: b.meta.block_tables.shape[1]]
        b.meta.block_tables_host[which] = alone.meta.block_tables_host[0]
        ctx, n = seqs[which]
        start = b.meta.query_start_loc[which].item()
        b.q[start : start + n] = alone.q[ctx : ctx + n]
        return run_unified(b, 0.25)[start : start + n]

    for ctx, n in [(0, 16), (16, 16), (32, 13), (44, 1), (10, 7)]:
        assert torch.equal(rows_when([(ctx, n)], 0), full[ctx : ctx + n])
    # Beside a decode row, an empty sequence and another prefill, in the middle of the batch.
    got = rows_when([(3, 1), (0, 0), (32, 13), (0, 20)], 2)
    assert torch.equal(got, full[32:45])


# --------------------------------------------------------------------------- split-KV decode

DECODE_LENS = [1, 31, 32, 33, 64, 100, 16, 17]


def decode_batch(lens: list[int], **kw) -> Batch:
    return make_batch([(n - 1, 1) for n in lens], **kw)


def run_split(batch: Batch, scale: float, **kw) -> torch.Tensor:
    m = batch.meta
    return split_kv_decode_attention(
        batch.q, batch.k_cache, batch.v_cache, m.seq_lens, m.block_tables, scale, m.max_seq_len, **kw
    )


@pytest.mark.parametrize(
    "group,head_dim,dtype,split_size,block_n",
    [
        (1, 16, torch.float32, 32, 16),
        (2, 48, torch.float16, 64, 32),
        (4, 32, torch.bfloat16, 32, 32),
        (4, 128, torch.float32, 512, None),  # the default split: one split per sequence here
    ],
)
def test_split_kv_decode_matches_reference(group, head_dim, dtype, split_size, block_n) -> None:
    batch = decode_batch(DECODE_LENS, hkv=2, group=group, head_dim=head_dim, dtype=dtype)
    out = run_split(batch, 0.3, split_size=split_size, block_n=block_n)
    assert out.shape == batch.q.shape and out.dtype == dtype
    assert rel_err(out, reference(batch, 0.3)) < TOL[dtype]


def test_split_kv_decode_is_deterministic_and_batch_invariant() -> None:
    cfg = dict(hkv=2, group=4, head_dim=32, dtype=torch.float32, seed=11)
    batch = decode_batch(DECODE_LENS, **cfg)
    first = run_split(batch, 0.3, split_size=32, block_n=16)
    assert torch.equal(run_split(batch, 0.3, split_size=32, block_n=16), first)
    # Each sequence alone (a smaller grid, fewer splits) and inside a reordered sub-batch.
    for i in range(len(DECODE_LENS)):
        one = Batch(batch.q[i : i + 1], batch.k_cache, batch.v_cache, _sub_meta(batch.meta, [i]), [], [])
        assert torch.equal(run_split(one, 0.3, split_size=32, block_n=16), first[i : i + 1])
    order = [5, 0, 3]
    sub = Batch(batch.q[order], batch.k_cache, batch.v_cache, _sub_meta(batch.meta, order), [], [])
    assert torch.equal(run_split(sub, 0.3, split_size=32, block_n=16), first[order])


def _sub_meta(meta: AttentionMetadata, rows: list[int]) -> AttentionMetadata:
    idx = torch.tensor(rows, device=DEVICE)
    seq_lens = meta.seq_lens[idx]
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping[idx],
        query_start_loc=torch.arange(len(rows) + 1, dtype=torch.int32, device=DEVICE),
        seq_lens=seq_lens,
        context_lens=meta.context_lens[idx],
        block_tables=meta.block_tables[idx],
        max_query_len=1,
        max_seq_len=int(seq_lens.max()),
        block_size=meta.block_size,
    )


def test_split_kv_decode_rejects_split_not_multiple_of_tile() -> None:
    batch = decode_batch([5], hkv=1, group=1, head_dim=16, dtype=torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        run_split(batch, 1.0, split_size=40, block_n=16)


# --------------------------------------------------------------------------- the backend


def new_kv(batch: Batch, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (batch.q.shape[0], batch.k_cache.shape[2], batch.k_cache.shape[3])
    dtype = batch.k_cache.dtype
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE), torch.randn(*shape, generator=gen).to(
        dtype
    ).to(DEVICE)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_backend_matches_torch_backend(deterministic: bool, dtype: torch.dtype) -> None:
    """Same caches and new K/V through both backends: identical cache contents, close outputs."""
    batch = make_batch(MIXED, hkv=2, group=2, head_dim=16, dtype=dtype, seed=5)
    k, v = new_kv(batch, 6)
    caches = [(batch.k_cache.clone(), batch.v_cache.clone()) for _ in range(2)]
    ours = TritonAttentionBackend(deterministic=deterministic)
    theirs = TorchAttentionBackend(deterministic=deterministic)
    out = ours.forward(batch.q, k, v, *caches[0], batch.meta, 0.25)
    batch.meta.backend_state = None
    expect = theirs.forward(batch.q, k, v, *caches[1], batch.meta, 0.25)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert rel_err(out, expect) < TOL[dtype]
    batch.k_cache, batch.v_cache = caches[0]
    assert rel_err(out, reference(batch, 0.25)) < TOL[dtype]


def test_backend_decode_step_uses_split_kv_outside_deterministic_mode() -> None:
    """A decode-only step longer than one split: the split-KV path in fast mode, the unified
    kernel in deterministic mode; both right, and the deterministic one equal to a prefill row."""
    lens = [130, 5, 70]
    batch = decode_batch(lens, hkv=2, group=2, head_dim=16, dtype=torch.float32, seed=9)
    k, v = new_kv(batch, 10)
    fast = TritonAttentionBackend(split_size=64)
    det = TritonAttentionBackend(deterministic=True, split_size=64)
    out_fast = fast.forward(batch.q, k, v, batch.k_cache, batch.v_cache, batch.meta, 0.25)
    out_det = det.forward(batch.q, k, v, batch.k_cache, batch.v_cache, batch.meta, 0.25)
    ref = reference(batch, 0.25)
    assert rel_err(out_fast, ref) < 1e-5 and rel_err(out_det, ref) < 1e-5
    split_only = split_kv_decode_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.meta.seq_lens,
        batch.meta.block_tables,
        0.25,
        batch.meta.max_seq_len,
        split_size=64,
    )
    assert torch.equal(out_fast, split_only)
    assert torch.equal(out_det, run_unified(batch, 0.25))


def test_backend_skips_padding_slots() -> None:
    batch = make_batch([(0, 3)], hkv=1, group=1, head_dim=16, dtype=torch.float32, seed=12)
    batch.meta.slot_mapping[2] = -1
    k, v = new_kv(batch, 13)
    before = batch.k_cache.clone()
    TritonAttentionBackend().forward(batch.q, k, v, batch.k_cache, batch.v_cache, batch.meta, 1.0)
    flat_new, flat_old = batch.k_cache.view(-1, 1, 16), before.view(-1, 1, 16)
    slots = batch.meta.slot_mapping
    assert torch.equal(flat_new[slots[:2]], k[:2])
    changed = (flat_new != flat_old).any(dim=(1, 2)).nonzero().flatten().tolist()
    assert sorted(changed) == sorted(slots[:2].tolist())


def test_registry_builds_the_triton_backend() -> None:
    backend = get_attention_backend("triton", DEVICE, deterministic=True)
    assert isinstance(backend, TritonAttentionBackend) and backend.name == "triton" and backend.deterministic
