"""Chunked local attention (Llama 4's ``attention_chunk_size``) in both attention backends and the
Triton kernels, against a float64 reference with transformers' chunked mask: a query at position q
sees the keys k <= q with ``k // chunk == q // chunk`` (and, when a window is given too, only those
inside it).

Batches put decode rows at, just past and far past chunk boundaries, first chunks spanning several
attention chunks and prefill chunks that start inside one, over blocks (4) that chunks (6, 8) cross.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # never force the interpreter onto a real GPU run
    os.environ["TRITON_INTERPRET"] = "1"

from engine.attention.base import lowest_key  # noqa: E402
from engine.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from tests.engine.attention_reference import max_err, reference_attention  # noqa: E402
from tests.engine.test_sliding_window import _paged_batch, _sub_meta  # noqa: E402

SEQS = [(0, 1), (7, 1), (8, 1), (9, 1), (47, 1), (70, 1), (0, 23), (3, 12), (30, 9), (66, 4), (0, 1)]
# (window, chunk) pairs a layer may have; (None, None) is plain causal attention.
LIMITS = [(None, 8), (None, 6), (None, 1), (None, 64), (10, 8), (5, 8), (None, None), (None, 8)]


def test_lowest_key() -> None:
    assert [lowest_key(p, None, 8) for p in (0, 7, 8, 15, 16, 70)] == [0, 0, 8, 8, 16, 64]
    assert [lowest_key(p, 10, 8) for p in (0, 9, 12, 17, 70)] == [0, 8, 8, 16, 64]
    assert [lowest_key(p, 3, 8) for p in (0, 9, 12, 70)] == [0, 8, 10, 68]
    assert lowest_key(40, None, None) == 0


def test_chunk_changes_the_answer() -> None:
    """The references differ, so matching them below means the backends applied the chunk."""
    q, _, _, kc, vc, meta = _paged_batch(SEQS, seed=3)
    assert (
        max_err(
            reference_attention(q, kc, vc, meta, 0.3, None, 8),
            reference_attention(q, kc, vc, meta, 0.3, None, None),
        )
        > 1e-2
    )


@pytest.mark.parametrize("deterministic", [False, True])
def test_torch_backend_chunks_match_reference(deterministic: bool) -> None:
    q, k, v, kc, vc, meta = _paged_batch(SEQS, seed=3)
    backend = TorchAttentionBackend(deterministic=deterministic)
    # One step's metadata through layers of different limits (and again: plans are reused).
    for window, chunk in LIMITS:
        out = backend.forward(q, k, v, kc, vc, meta, 0.3, window, chunk=chunk)
        assert max_err(out, reference_attention(q, kc, vc, meta, 0.3, window, chunk)) < 1e-5, (window, chunk)
    assert set(meta.backend_state.windows) == set(LIMITS)
    if deterministic:
        # A long sequence's rows are the same bits alone, chunked, or as decode rows.
        q1, k1, v1, kc1, vc1, meta1 = _paged_batch([(0, 70)], seed=4)
        alone = backend.forward(q1, k1, v1, kc1, vc1, meta1, 0.3, chunk=8)
        for ctx, n in [(0, 33), (33, 31), (64, 6), (69, 1), (41, 1), (8, 1)]:
            rows = slice(ctx, ctx + n)
            got = backend.forward(
                q1[rows], k1[rows], v1[rows], kc1, vc1, _sub_meta(meta1, ctx, n), 0.3, chunk=8
            )
            assert torch.equal(got, alone[rows]), (ctx, n)


def test_triton_kernels_chunks_match_reference() -> None:
    pytest.importorskip("triton", reason="triton is not installed (pip install 'ferry-serve[triton]')")
    from engine.kernels.triton_attention import unified_attention
    from engine.kernels.triton_decode import split_kv_decode_attention

    q, _, _, kc, vc, meta = _paged_batch(SEQS, seed=5)
    for window, chunk in [(None, 8), (None, 6), (5, 8), (None, 1)]:
        out = unified_attention(q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.3,
                                window=window, chunk=chunk, block_n=16)  # fmt: skip
        assert max_err(out, reference_attention(q, kc, vc, meta, 0.3, window, chunk)) < 1e-5, (window, chunk)
    # Decode rows whose chunk starts in an earlier split, at a split boundary, inside their split.
    dec = [(n - 1, 1) for n in (1, 9, 40, 41, 64, 65, 70, 100)]
    q, _, _, kc, vc, meta = _paged_batch(dec, seed=6)
    for window, chunk in [(None, 40), (None, 8), (30, 48)]:
        out = split_kv_decode_attention(q, kc, vc, meta.seq_lens, meta.block_tables, 0.3, meta.max_seq_len,
                                        window=window, chunk=chunk, split_size=32, block_n=16)  # fmt: skip
        assert max_err(out, reference_attention(q, kc, vc, meta, 0.3, window, chunk)) < 1e-5, (window, chunk)
    # Deterministic promise: a prompt's rows are the same bits however it is chunked.
    q, _, _, kc, vc, meta = _paged_batch([(0, 70)], seed=7)
    full = unified_attention(q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.3,
                             chunk=8, block_n=16)  # fmt: skip
    for ctx, n in [(0, 20), (20, 29), (49, 21), (69, 1)]:
        m = _sub_meta(meta, ctx, n)
        got = unified_attention(q[ctx : ctx + n], kc, vc, m.query_start_loc, m.seq_lens, m.block_tables, 0.3,
                                chunk=8, block_n=16)  # fmt: skip
        assert torch.equal(got, full[ctx : ctx + n]), (ctx, n)
    with pytest.raises(ValueError, match="chunk"):
        unified_attention(q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.3, chunk=0)


def test_triton_backend_chunks_in_both_paths() -> None:
    """A mixed step takes the unified kernel; a decode step whose chunk spans several splits takes
    the split-KV path; one whose chunk fits a split stays on the unified kernel."""
    pytest.importorskip("triton", reason="triton is not installed (pip install 'ferry-serve[triton]')")
    from engine.attention.triton_backend import TritonAttentionBackend

    backend = TritonAttentionBackend(split_size=64)
    q, k, v, kc, vc, meta = _paged_batch(SEQS, seed=9)
    out = backend.forward(q, k, v, kc, vc, meta, 0.3, chunk=8)
    assert max_err(out, reference_attention(q, kc, vc, meta, 0.3, None, 8)) < 1e-5
    q, k, v, kc, vc, meta = _paged_batch([(129, 1), (4, 1), (69, 1), (150, 1)], seed=8)
    for chunk in (100, 8):
        out = backend.forward(q, k, v, kc, vc, meta, 0.3, chunk=chunk)
        assert max_err(out, reference_attention(q, kc, vc, meta, 0.3, None, chunk)) < 1e-5, chunk
