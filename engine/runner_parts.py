"""Pieces the model runner and the draft model (engine/draft_model.py) share: reading a checkpoint's
weights, sizing and allocating a paged KV cache, and laying requests out as one flattened batch."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from engine.attention import AttentionMetadata
from engine.models.config import ModelConfig, read_hf_config
from engine.models.dummy import dummy_weights
from engine.models.kv_scales import SCALE_SUFFIXES
from engine.models.loader import load_weights
from engine.models.registry import get_model_class

# One request's tokens in a flattened batch: (token ids, position of the first, block table).
Segment = tuple[list[int], int, list[int]]


def build_batch(
    segments: list[Segment], block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Input ids, positions and attention metadata of requests laid out back to back; each token's
    KV goes to the slot its block table gives its position."""
    bs = block_size
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    qsl = [0]
    seq_lens: list[int] = []
    ctx_lens: list[int] = []
    qlens: list[int] = []
    tables: list[list[int]] = []
    for tokens, start, table in segments:
        n = len(tokens)
        ids.extend(tokens)
        rng = range(start, start + n)
        pos.extend(rng)
        slots.extend(table[p // bs] * bs + p % bs for p in rng)
        qsl.append(qsl[-1] + n)
        seq_lens.append(start + n)
        ctx_lens.append(start)
        qlens.append(n)
        tables.append(table)
    width = max(len(t) for t in tables)
    dev = device
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        context_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=dev),
        block_tables=torch.tensor(
            [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev
        ),
        max_query_len=max(qlens),
        max_seq_len=max(seq_lens),
        query_lens_host=qlens,
        seq_lens_host=seq_lens,
        context_lens_host=ctx_lens,
        block_tables_host=tables,
        block_size=bs,
    )
    input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
    positions = torch.tensor(pos, dtype=torch.long, device=dev)
    return input_ids, positions, meta


def split_batch(segments: list[Segment], budget: int) -> Iterator[tuple[list[Segment], int, int]]:
    """The segments laid out back to back, cut into forwards of at most ``budget`` tokens (a segment
    may be cut: its later piece starts where the earlier one ended, whose KV is then stored): each
    forward's segments and the rows ``[first, end)`` of the whole layout it covers."""
    chunk: list[Segment] = []
    first = row = 0
    for tokens, start, table in segments:
        lo = 0
        while lo < len(tokens):
            take = min(len(tokens) - lo, budget - (row - first))
            chunk.append((tokens[lo : lo + take], start + lo, table))
            lo += take
            row += take
            if row - first == budget:
                yield chunk, first, row
                chunk, first = [], row
    if chunk:
        yield chunk, first, row


def read_weights(
    model_dir: Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    hf_overrides: dict | None,
    dummy: bool,
) -> dict[str, torch.Tensor]:
    """A checkpoint's weights as its architecture's model class names them (random for ``dummy``);
    KV cache scales among them (engine/models/kv_scales.py) stay fp32."""
    model_cls = get_model_class(cfg.architecture)
    renames = getattr(model_cls, "WEIGHT_RENAMES", {}).get(cfg.architecture, ())
    keep_fp32 = (*getattr(model_cls, "FP32_WEIGHTS", ()), *SCALE_SUFFIXES)
    if dummy:
        return dummy_weights(read_hf_config(model_dir, hf_overrides), dtype, device, keep_fp32, renames)
    return load_weights(
        model_dir, dtype, device, keep_fp32, cfg.num_layers, renames, cfg.fp8_block, cfg.weight_quant
    )


def kv_block_bytes(cfg: ModelConfig, block_size: int, kv_dtype: torch.dtype) -> int:
    per_token = cfg.kv_cache_parts * cfg.kv_cache_heads * cfg.kv_cache_dim
    return cfg.num_layers * block_size * per_token * kv_dtype.itemsize


def allocate_kv(
    cfg: ModelConfig, num_blocks: int, block_size: int, kv_dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, ...]]:
    """Per layer (k, v), or (latent,) for MLA models. Zeroed, not empty: padded attention reads
    unused slots, which must hold finite numbers."""
    shape = (num_blocks, block_size, cfg.kv_cache_heads, cfg.kv_cache_dim)
    return [
        tuple(torch.zeros(shape, dtype=kv_dtype, device=device) for _ in range(cfg.kv_cache_parts))
        for _ in range(cfg.num_layers)
    ]


def position_limit(cfg: ModelConfig) -> tuple[int, str]:
    """The positions a model was trained for, and where that number comes from."""
    limit, source = cfg.max_position_embeddings, f"max_position_embeddings={cfg.max_position_embeddings}"
    if cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "linear":
        # Linear scaling stretches the trained positions by its factor (vLLM derives the same);
        # llama3's config already states the extended length.
        factor = float(cfg.rope_scaling["factor"])
        limit, source = int(limit * factor), f"{source} x linear rope scaling factor {factor:g}"
    return limit, source
