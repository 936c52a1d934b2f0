"""The attention backend interface and the per-step metadata every backend reads.

The runner builds one ``AttentionMetadata`` per forward step (never per layer) and hands it to
every layer's backend call. The KV cache layout is fixed by ARCHITECTURE.md: per layer
``k_cache``/``v_cache`` of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``; a token's
slot is ``block_id * block_size + offset``. A backend must never change that layout, because the
KV tier's codec and the other backends read the same bytes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Where each new token of a flattened (mixed prefill + decode) batch goes and what it sees.

    Batch order is the order of sequences in the flattened token dimension ``T``. Device tensors
    are what kernels read; the host lists mirror them for backends that loop in Python (the torch
    backend) so they never force a device-to-host copy.
    """

    slot_mapping: torch.Tensor  # int64 [T]: cache slot of each new token
    query_start_loc: torch.Tensor  # int32 [B+1]: cumulative new-token counts, batch order
    seq_lens: torch.Tensor  # int32 [B]: tokens in context after this step (cached + new)
    context_lens: torch.Tensor  # int32 [B]: tokens already in the cache before this step
    block_tables: torch.Tensor  # int32 [B, max_blocks_per_seq], padded with 0
    max_query_len: int
    max_seq_len: int
    # Host-side mirrors (python ints), same order as the tensors above.
    query_lens_host: list[int] = field(default_factory=list)
    seq_lens_host: list[int] = field(default_factory=list)
    context_lens_host: list[int] = field(default_factory=list)
    block_tables_host: list[list[int]] = field(default_factory=list)
    block_size: int = 16
    # A backend may stash data derived from this metadata here (built by the first layer's call,
    # reused by the others), so per-step preparation is never repeated per layer.
    backend_state: object | None = None

    @classmethod
    def for_chunks(
        cls,
        chunks: Sequence[tuple[int, int]],
        tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """The runner's layout for sequences given as ``(context_len, new_tokens)`` chunks over
        block ``tables`` (the tensor padded with block 0 to the longest; the host lists as given):
        for callers of the kernels other than the runner, such as tests and kernel benchmarks."""
        host = [list(t) for t in tables]
        width = max((len(t) for t in host), default=0)
        starts, slots = [0], []
        for (ctx, n), table in zip(chunks, host, strict=True):
            starts.append(starts[-1] + n)
            slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx, ctx + n)]
        qlens = [n for _, n in chunks]
        ctxs = [c for c, _ in chunks]
        lens = [c + n for c, n in chunks]
        padded = [t + [0] * (width - len(t)) for t in host]
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
            context_lens=torch.tensor(ctxs, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device).reshape(len(host), width),
            max_query_len=max(qlens, default=0),
            max_seq_len=max(lens, default=0),
            query_lens_host=qlens,
            seq_lens_host=lens,
            context_lens_host=ctxs,
            block_tables_host=host,
            block_size=block_size,
        )

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


FP8_DTYPES = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})


def raw(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as its bytes (a uint8 view of the same storage), anything else as itself:
    indexed copies are not implemented for fp8 on every device, and bytes are what they move."""
    return t.view(torch.uint8) if t.dtype in FP8_DTYPES else t


def to_cache(rows: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """``rows`` as a cache of ``dtype`` stores them. An fp8 cache holds ``rows / scale`` (computed in
    fp32) rounded to fp8, saturated at the format's largest finite value as vLLM's cache writes
    are: a value past it would otherwise become NaN."""
    if dtype not in FP8_DTYPES:
        return rows.to(dtype)
    top = torch.finfo(dtype).max
    rows = rows.float() if scale == 1.0 else rows.float() / scale
    return rows.clamp(-top, top).to(dtype)


def store_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, scale: float = 1.0) -> None:
    """Write ``rows`` [T, H, D] at ``slots`` of a paged cache [blocks, block_size, H, D], converted
    to the cache's dtype (``to_cache``: an fp8 cache rounds ``rows / scale``)."""
    flat = cache.view(-1, *cache.shape[2:])
    raw(flat).index_copy_(0, slots, raw(to_cache(rows, cache.dtype, scale)))


def lowest_key(q_pos: int, window: int | None, chunk: int | None) -> int:
    """The first key position a query at ``q_pos`` sees under a sliding ``window`` and a ``chunk``
    (either None: no such limit); keys up to ``q_pos`` from there on are all visible."""
    low = 0 if window is None else max(q_pos - window + 1, 0)
    return low if chunk is None else max(low, q_pos // chunk * chunk)


class AttentionBackend(ABC):
    """Writes new K/V into the paged cache and runs causal attention for the new tokens.

    Chosen once at engine start (``registry.get_attention_backend``); the hot path never branches
    on which backend runs.
    """

    name: str = "abstract"

    def __init__(self, *, deterministic: bool = False) -> None:
        # Deterministic backends must give each query row a result that depends only on its own
        # sequence (batch-invariant), whatever else shares the step.
        self.deterministic = deterministic

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,  # [Hq] fp32
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        chunk: int | None = None,
        alibi: torch.Tensor | None = None,  # [Hq] fp32 slopes
    ) -> torch.Tensor:  # [T, Hq, D]
        """Store ``k``/``v`` at ``meta.slot_mapping``, then attend each new token over its sequence's
        cached prefix plus the new tokens up to and including itself (GQA: query head h reads KV head
        ``h // (Hq // Hkv)``). With a sliding ``window``, the token at position q sees only keys at
        positions k with ``q - window < k <= q``. With a ``chunk`` (Llama 4's chunked local attention)
        it sees only keys of its own chunk: ``q // chunk == k // chunk`` (both limits may apply; the
        first key a query sees is ``lowest_key``'s). With ``softcap`` (Gemma 2), the scaled scores
        become ``softcap * tanh(score / softcap)`` before the softmax. With ``sinks`` (gpt-oss),
        head h's softmax has one more logit, ``sinks[h]``, whose value is zero: it takes probability
        mass and adds nothing. A model passes ``sinks`` only if it has them (decided at load). With
        ``alibi`` (Bloom, MPT: ``alibi_slopes``), head h's scaled score for key position k from query
        position q gets ``alibi[h] * (k - q)`` added, in fp32; transformers adds ``slope * k`` (Bloom)
        or ``slope * (k - last)`` (MPT), which differ from it by a constant per query row, and the
        softmax does not see those. The bias depends only on positions, so prefix hits, chunked
        prefill and the KV tier stay exact.
        ``k_scale`` / ``v_scale`` (engine/models/kv_scales.py): an fp8 cache stores ``k / k_scale``
        and is read as its values times ``k_scale`` (V likewise); a model passes 1.0 for every other
        cache."""

    @abstractmethod
    def forward_mla(
        self,
        q: torch.Tensor,  # [T, Hq, Dk]: per head, the query in the latent space plus its rotary part
        kv: torch.Tensor,  # [T, 1, Dk]: each token's latent (kv_lora_rank) plus its rotated key
        kv_cache: torch.Tensor,  # [num_blocks, block_size, 1, Dk]
        meta: AttentionMetadata,
        scale: float,
        v_dim: int,
        kv_scale: float = 1.0,
    ) -> torch.Tensor:  # [T, Hq, v_dim]
        """Multi-head latent attention in its absorbed form (DeepSeek V2/V3): store ``kv`` at
        ``meta.slot_mapping``, then attend as one shared KV head whose values are the first
        ``v_dim`` dims of the keys (the latent), causally as in ``forward``. An fp8 latent cache is
        scaled by ``kv_scale`` as ``forward``'s caches are by ``k_scale``."""
