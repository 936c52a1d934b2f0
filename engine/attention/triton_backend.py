"""The Triton attention backend: paged KV-cache write plus paged attention in Triton kernels.

One ``unified_attention`` launch serves a whole mixed batch (prefill chunks, prefix-hit tails
and decode rows alike). Outside ``--deterministic`` mode, decode-only steps whose longest
context spans more than one KV split use the split-KV decode kernel instead, which spreads a long
context over more programs. In deterministic mode every step uses the unified kernel, whose
per-row result is independent of the batch and of how a prompt was chunked; switching kernels
by batch shape would break that.

Attention sinks (gpt-oss) join both kernels as a value-less softmax column per query head
(``SINKS``, compiled in only for models that have them).

Runs on CUDA, or on CPU under Triton's interpreter (``TRITON_INTERPRET=1``, tests only).
"""

from __future__ import annotations

import importlib.util

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata, store_rows


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self, *, deterministic: bool = False, split_size: int | None = None) -> None:
        super().__init__(deterministic=deterministic)
        if importlib.util.find_spec("triton") is None:
            raise RuntimeError(
                "attention_backend='triton' needs the triton package: pip install 'ferry-serve[triton]'"
            )
        from engine.kernels import interpreting, triton_attention, triton_decode, triton_mla, triton_ops

        if not torch.cuda.is_available() and not interpreting():
            raise RuntimeError(
                "attention_backend='triton' needs a CUDA GPU (or TRITON_INTERPRET=1 to run the "
                "kernels slowly on CPU); use attention_backend='torch' on this machine"
            )
        self._write_kv = triton_ops.write_kv_cache
        self._unified = triton_attention.unified_attention
        self._split_decode = triton_decode.split_kv_decode_attention
        # Latent attention (one 512+64-wide shared head, values inside the keys): its own kernel.
        self._mla = triton_mla.mla_attention
        self._token_positions = triton_mla.token_positions
        self._mla_plan: tuple[AttentionMetadata, torch.Tensor, torch.Tensor] | None = None
        self.split_size = split_size or triton_decode.DEFAULT_SPLIT_SIZE
        if self.split_size % 64:
            raise ValueError(
                f"split_size must be a multiple of 64 (the largest KV tile), got {self.split_size}"
            )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        chunk: int | None = None,
        alibi: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self._write_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        if q.stride(-1) != 1:
            q = q.contiguous()
        num_seqs = meta.seq_lens.shape[0]
        span = min(meta.max_seq_len, window or meta.max_seq_len, chunk or meta.max_seq_len)
        if (
            not self.deterministic
            and meta.max_query_len == 1
            and q.shape[0] == num_seqs
            and span > self.split_size
        ):
            # Decode-only step (exactly one query per sequence) with a long context to attend to.
            return self._split_decode(
                q, k_cache, v_cache, meta.seq_lens, meta.block_tables, scale, meta.max_seq_len,
                window=window, softcap=softcap, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
                chunk=chunk, alibi=alibi, split_size=self.split_size,
            )  # fmt: skip
        return self._unified(
            q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale,
            window=window, softcap=softcap, sinks=sinks, k_scale=k_scale, v_scale=v_scale, chunk=chunk,
            alibi=alibi,
        )  # fmt: skip

    def forward_mla(self, q, kv, kv_cache, meta, scale, v_dim, kv_scale=1.0):  # type: ignore[override]
        store_rows(kv_cache, meta.slot_mapping, kv.view(-1, 1, kv_cache.shape[3]), kv_scale)
        plan = self._mla_plan
        if plan is None or plan[0] is not meta:  # once per step, not per layer
            seqs, positions = self._token_positions(meta.query_start_loc, meta.seq_lens, q.shape[0])
            plan = self._mla_plan = (meta, seqs, positions)
        return self._mla(q, kv_cache, plan[1], plan[2], meta.block_tables, scale, v_dim, kv_scale)
