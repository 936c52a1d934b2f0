"""Triton latent attention (engine/kernels/triton_mla.py) against the torch backend's ``forward_mla``
on the same paged batches: mixed prefill chunks, prefix-hit tails and decodes; fp32 and bf16;
batch invariance bit for bit. Without a GPU the kernel runs under Triton's interpreter."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # never force the interpreter onto a real GPU run
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton", reason="triton is not installed (pip install 'ferry-serve[triton]')")

from engine.attention.base import AttentionMetadata  # noqa: E402
from engine.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from engine.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from engine.kernels.triton_mla import token_positions  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
V_DIM, ROPE, HEADS, BLOCK = 32, 16, 5, 4  # 5 heads: one partial block of 16; 4-token KV blocks
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


def _batch(chunks: list[tuple[int, int]], dtype: torch.dtype, seed: int = 0):
    """(q, new latent rows, cache holding every context row, meta) for ``(context, new)`` chunks."""
    g = torch.Generator().manual_seed(seed)
    width = V_DIM + ROPE
    tables, next_block = [], 1
    for ctx, n in chunks:
        need = -(-(ctx + n) // BLOCK)
        tables.append(list(range(next_block + need - 1, next_block - 1, -1)))  # scattered, reversed
        next_block += need
    cache = torch.randn(next_block + 1, BLOCK, 1, width, generator=g).to(DEVICE, dtype)
    meta = AttentionMetadata.for_chunks(chunks, tables, BLOCK, DEVICE)
    t = sum(n for _, n in chunks)
    q = torch.randn(t, HEADS, width, generator=g).to(DEVICE, dtype)
    kv = torch.randn(t, 1, width, generator=g).to(DEVICE, dtype)
    return q, kv, cache, meta


def _both(chunks, dtype, seed=0) -> tuple[torch.Tensor, torch.Tensor]:
    q, kv, cache, meta = _batch(chunks, dtype, seed)
    scale = (V_DIM + ROPE) ** -0.5
    ref = TorchAttentionBackend().forward_mla(q, kv, cache.clone(), meta, scale, V_DIM)
    got = TritonAttentionBackend().forward_mla(q, kv, cache.clone(), meta, scale, V_DIM)
    return got, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "chunks",
    [
        [(0, 7)],  # a first prefill chunk
        [(9, 1), (0, 5), (13, 3), (2, 1)],  # decodes, a fresh prompt, a prefix-hit tail
        [(40, 1)] * 3,  # decode only, contexts over several key tiles
    ],
)
def test_equals_the_torch_backend(chunks, dtype: torch.dtype) -> None:
    got, ref = _both(chunks, dtype)
    assert got.shape == ref.shape == (sum(n for _, n in chunks), HEADS, V_DIM) and got.dtype == dtype
    err = float((got.double() - ref.double()).abs().max() / ref.double().abs().max())
    assert err <= TOL[dtype], err


def test_the_new_rows_are_written_to_the_cache() -> None:
    q, kv, cache, meta = _batch([(3, 2), (0, 1)], torch.float32)
    TritonAttentionBackend().forward_mla(q, kv, cache, meta, 0.1, V_DIM)
    rows = cache.view(-1, V_DIM + ROPE).index_select(0, meta.slot_mapping)
    assert torch.equal(rows, kv.view(-1, V_DIM + ROPE))


def test_a_tokens_result_does_not_depend_on_its_batch() -> None:
    chunks = [(9, 1), (0, 5), (13, 3)]
    q, kv, cache, meta = _batch(chunks, torch.float32)
    backend = TritonAttentionBackend()
    together = backend.forward_mla(q, kv, cache.clone(), meta, 0.2, V_DIM)
    alone_meta = AttentionMetadata.for_chunks([chunks[2]], [meta.block_tables_host[2]], BLOCK, DEVICE)
    alone = backend.forward_mla(q[6:], kv[6:], cache.clone(), alone_meta, 0.2, V_DIM)
    assert torch.equal(alone, together[6:])


def test_token_positions() -> None:
    starts = torch.tensor([0, 1, 6, 6, 9], dtype=torch.int32, device=DEVICE)  # a sequence with no new token
    lens = torch.tensor([10, 5, 4, 16], dtype=torch.int32, device=DEVICE)
    seqs, positions = token_positions(starts, lens, 9)
    assert seqs.tolist() == [0, 1, 1, 1, 1, 1, 3, 3, 3]
    assert positions.tolist() == [9, 0, 1, 2, 3, 4, 13, 14, 15]


def test_a_tokens_result_does_not_depend_on_how_its_prompt_was_chunked() -> None:
    """A 12-token prompt in one chunk, or as 7 then 5 over the cached first part: the same bits."""
    q, kv, cache, meta = _batch([(0, 12)], torch.float32, seed=3)
    backend = TritonAttentionBackend()
    whole = backend.forward_mla(q, kv, cache.clone(), meta, 0.2, V_DIM)
    table = meta.block_tables_host[0]
    chunked_cache = cache.clone()
    first = AttentionMetadata.for_chunks([(0, 7)], [table[:2]], BLOCK, DEVICE)
    second = AttentionMetadata.for_chunks([(7, 5)], [table], BLOCK, DEVICE)
    head = backend.forward_mla(q[:7], kv[:7], chunked_cache, first, 0.2, V_DIM)
    tail = backend.forward_mla(q[7:], kv[7:], chunked_cache, second, 0.2, V_DIM)
    assert torch.equal(torch.cat([head, tail]), whole)
