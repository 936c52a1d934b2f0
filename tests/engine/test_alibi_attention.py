"""ALiBi attention (Bloom, MPT) in both attention backends and the Triton kernels, against a float64
reference that adds the bias as transformers' Bloom does (``slope * k_pos``, the same softmax as the
backends' ``slope * (k_pos - q_pos)``, shifted by a constant per query row), and the slopes against
transformers' own functions, bit for bit.

Batches put decode rows near and far from position 0, first chunks and prefill chunks behind a
cached prefix, over blocks of 4 that the sequences cross: the bias of a key is its distance to the
query, so what must hold on every path is that a row's keys are measured in one frame with steep
slopes (distance 70 is ~17 logits) that make any mix-up of heads, rows or key offsets visible.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # never force the interpreter onto a real GPU run
    os.environ["TRITON_INTERPRET"] = "1"

from engine.attention.alibi import bloom_alibi_slopes, mpt_alibi_slopes  # noqa: E402
from engine.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from tests.engine.attention_reference import max_err, reference_attention  # noqa: E402
from tests.engine.test_sliding_window import _paged_batch, _sub_meta  # noqa: E402

SEQS = [(0, 1), (7, 1), (47, 1), (70, 1), (0, 23), (3, 12), (30, 9), (66, 4), (0, 1)]


def _slopes(hq: int, device: torch.device) -> torch.Tensor:
    """Steep slopes (Bloom's rule for half as many heads), so a bias of distance 70 is ~17 logits."""
    return bloom_alibi_slopes(hq).to(device) * 4


@pytest.mark.parametrize("n_heads", [1, 2, 4, 5, 6, 12, 16, 30, 32, 71, 112])
def test_slopes_match_transformers(n_heads: int) -> None:
    """Bloom's rule (powers of two and not: bloom-560m has 16 heads, bloom-7b1 32, bloom 112) and
    MPT's (with its ``alibi_bias_max``), the same fp32 bits as transformers computes."""
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    assert torch.equal(bloom_alibi_slopes(n_heads), _get_alibi_slopes(n_heads, torch.device("cpu")))
    for bias_max in (8, 16, 5.5):
        # MPT's bias for a 2-token sequence: key 0 gets -slope, key 1 gets 0.
        ref = -build_mpt_alibi_tensor(n_heads, 2, bias_max)[:, 0, 0]
        assert torch.equal(mpt_alibi_slopes(n_heads, bias_max), ref), bias_max
    assert bloom_alibi_slopes(8).tolist() == [2.0**-i for i in range(1, 9)]


def test_alibi_changes_the_answer() -> None:
    """The references differ, so matching them below means the backends applied the bias."""
    q, _, _, kc, vc, meta = _paged_batch(SEQS, seed=3)
    slopes = _slopes(q.shape[1], q.device)
    assert (
        max_err(
            reference_attention(q, kc, vc, meta, 0.3, slopes=slopes),
            reference_attention(q, kc, vc, meta, 0.3),
        )
        > 1e-2
    )


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("group", [1, 2])
def test_torch_backend_alibi_matches_reference(deterministic: bool, group: int) -> None:
    q, k, v, kc, vc, meta = _paged_batch(SEQS, group=group, seed=3)
    slopes = _slopes(q.shape[1], q.device)
    backend = TorchAttentionBackend(deterministic=deterministic)
    for window in (None, 10):
        out = backend.forward(q, k, v, kc, vc, meta, 0.3, window, alibi=slopes)
        assert max_err(out, reference_attention(q, kc, vc, meta, 0.3, window, slopes=slopes)) < 1e-5, window
    if deterministic:
        # A long sequence's rows are the same bits alone, chunked, behind a prefix, or as decode rows.
        q1, k1, v1, kc1, vc1, meta1 = _paged_batch([(0, 70)], group=group, seed=4)
        alone = backend.forward(q1, k1, v1, kc1, vc1, meta1, 0.3, alibi=slopes)
        for ctx, n in [(0, 33), (33, 31), (64, 6), (69, 1), (41, 1), (8, 1)]:
            rows = slice(ctx, ctx + n)
            got = backend.forward(
                q1[rows], k1[rows], v1[rows], kc1, vc1, _sub_meta(meta1, ctx, n), 0.3, alibi=slopes
            )
            assert torch.equal(got, alone[rows]), (ctx, n)


def test_torch_backend_alibi_in_bf16() -> None:
    """A bf16 model's bias stays fp32: rounded to bf16, a bias near -17 would be off by 0.06."""
    q, k, v, kc, vc, meta = _paged_batch(SEQS, seed=11)
    slopes = _slopes(q.shape[1], q.device)
    q, k, v, kc, vc = (t.bfloat16() for t in (q, k, v, kc, vc))
    ref = reference_attention(q, kc, vc, meta, 0.3, slopes=slopes)
    for deterministic in (False, True):
        out = TorchAttentionBackend(deterministic=deterministic).forward(
            q, k, v, kc, vc, meta, 0.3, alibi=slopes
        )
        assert max_err(out, ref) < 2e-2, deterministic


def test_triton_kernels_alibi_match_reference() -> None:
    pytest.importorskip("triton", reason="triton is not installed (pip install 'ferry-serve[triton]')")
    from engine.kernels.triton_attention import unified_attention
    from engine.kernels.triton_decode import split_kv_decode_attention

    q, _, _, kc, vc, meta = _paged_batch(SEQS, seed=5)
    slopes = _slopes(q.shape[1], q.device)
    for window in (None, 10):
        out = unified_attention(q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.3,
                                window=window, alibi=slopes, block_n=16)  # fmt: skip
        assert max_err(out, reference_attention(q, kc, vc, meta, 0.3, window, slopes=slopes)) < 1e-5, window
    # Decode rows over one split, at a split boundary, and several splits.
    dec = [(n - 1, 1) for n in (1, 9, 32, 33, 64, 70, 100)]
    q, _, _, kc, vc, meta = _paged_batch(dec, group=1, seed=6)
    slopes = _slopes(q.shape[1], q.device)
    out = split_kv_decode_attention(q, kc, vc, meta.seq_lens, meta.block_tables, 0.3, meta.max_seq_len,
                                    alibi=slopes, split_size=32, block_n=16)  # fmt: skip
    assert max_err(out, reference_attention(q, kc, vc, meta, 0.3, slopes=slopes)) < 1e-5
    # Deterministic promise: a prompt's rows are the same bits however it is chunked.
    q, _, _, kc, vc, meta = _paged_batch([(0, 70)], seed=7)
    full = unified_attention(q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.3,
                             alibi=slopes, block_n=16)  # fmt: skip
    for ctx, n in [(0, 20), (20, 29), (49, 21), (69, 1)]:
        m = _sub_meta(meta, ctx, n)
        got = unified_attention(q[ctx : ctx + n], kc, vc, m.query_start_loc, m.seq_lens, m.block_tables, 0.3,
                                alibi=slopes, block_n=16)  # fmt: skip
        assert torch.equal(got, full[ctx : ctx + n]), (ctx, n)


def test_triton_backend_alibi_in_both_paths() -> None:
    """A mixed step takes the unified kernel; a long decode step the split-KV one."""
    pytest.importorskip("triton", reason="triton is not installed (pip install 'ferry-serve[triton]')")
    from engine.attention.triton_backend import TritonAttentionBackend

    backend = TritonAttentionBackend(split_size=64)
    q, k, v, kc, vc, meta = _paged_batch(SEQS, seed=9)
    slopes = _slopes(q.shape[1], q.device)
    out = backend.forward(q, k, v, kc, vc, meta, 0.3, alibi=slopes)
    assert max_err(out, reference_attention(q, kc, vc, meta, 0.3, slopes=slopes)) < 1e-5
    q, k, v, kc, vc, meta = _paged_batch([(129, 1), (4, 1), (69, 1), (150, 1)], seed=8)
    out = backend.forward(q, k, v, kc, vc, meta, 0.3, alibi=slopes)
    assert max_err(out, reference_attention(q, kc, vc, meta, 0.3, slopes=slopes)) < 1e-5
