"""Llama 4's text decoder over the paged KV cache: ``Llama4ForCausalLM``, and the language model of
``Llama4ForConditionalGeneration`` checkpoints (Scout, Maverick) served text-only.

Differences from the Llama family, all as transformers 5 computes them (``modeling_llama4.py``):
* rotary in interleaved pairs (transformers multiplies complex numbers), on the rope layers only;
  every ``no_rope_layer_interval``-th layer is a NoPE layer (``no_rope_layers[i] == 0``);
* rope layers attend in chunks (``attention_chunk_size``: a query sees only the keys of its own chunk,
  the attention backends' ``chunk``); NoPE layers attend to the whole sequence;
* ``use_qk_norm``: q and k of the rope layers normalised after rotary by an RMSNorm without weight;
* ``attn_temperature_tuning``: a NoPE layer's queries scaled by a factor growing with the position;
* MoE layers every ``interleave_moe_layer_step``: a top-k sigmoid router whose score scales the
  expert's *input*, plus a shared expert; dense layers an MLP ``intermediate_size_mlp`` wide.

Chunked layers never let the block manager free blocks: ``layer_windows`` stay None (a chunk is not
a window), and the NoPE layers read the whole sequence anyway.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionMetadata
from engine.models.config import ModelConfig
from engine.models.decoder import DecoderBase, KVCache, Layer, apply_rope, head_norm, split_heads
from engine.models.moe import invariant_sigmoid, load_dense_mlp, run_experts


class Llama4ForCausalLM(DecoderBase):
    # A multimodal checkpoint served text-only: its language model's weights, not its vision tower.
    WEIGHT_RENAMES = {
        "Llama4ForConditionalGeneration": (
            ("language_model.model.", "model."),
            ("language_model.lm_head.", "lm_head."),
        )
    }

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], **options: Any) -> None:
        if cfg.llama4 is None:
            raise ValueError(f"{cfg.architecture} needs a llama4_text config")
        self.l4 = cfg.llama4
        self.chunks = cfg.llama4.layer_chunks
        super().__init__(cfg, weights, **options)

    def _rotary_tables(self, max_positions: int, device: torch.device) -> list[torch.Tensor | None]:
        tables = super()._rotary_tables(max_positions, device)
        return [table if rope else None for table, rope in zip(tables, self.l4.rope_layers, strict=True)]

    def _setup(self, w: dict[str, torch.Tensor]) -> None:
        self.sigmoid = invariant_sigmoid if self.deterministic else torch.sigmoid
        # The qk norm has no weight: RMSNorm times ones.
        self.qk_ones = torch.ones(self.cfg.head_dim, dtype=self.embed.dtype, device=self.embed.device)

    def _layer(self, w: dict[str, torch.Tensor], i: int) -> Layer:
        p = f"model.layers.{i}."
        a, f = p + "self_attn.", p + "feed_forward."
        names = ("q_proj", "k_proj", "v_proj")
        bias = None
        if a + "q_proj.bias" in w:
            bias = torch.cat([w.pop(a + n + ".bias") for n in names])
        layer = {
            "in_norm": w.pop(p + "input_layernorm.weight"),
            "qkv": torch.cat([w.pop(a + n + ".weight") for n in names]),
            "qkv_bias": bias,
            "o": w.pop(a + "o_proj.weight"),
            "o_bias": w.pop(a + "o_proj.bias", None),
            "post_norm": w.pop(p + "post_attention_layernorm.weight"),
        }
        if not self.l4.moe_layers[i]:
            return {**layer, **load_dense_mlp(w, f)}
        # transformers' experts: gate_up_proj [E, hidden, 2I] (gate first), down_proj [E, I, hidden].
        layer["w13"] = w.pop(f + "experts.gate_up_proj").transpose(1, 2).contiguous()
        layer["w2"] = w.pop(f + "experts.down_proj").transpose(1, 2).contiguous()
        layer["router"] = w.pop(f + "router.weight")
        shared = load_dense_mlp(w, f + "shared_expert.")
        layer["shared_gate_up"], layer["shared_down"] = shared["gate_up"], shared["down"]
        return layer

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden]: instead of the ids' embeddings
    ) -> torch.Tensor:
        """Hidden states after the final norm, ``[T, hidden]``."""
        cfg, ops, l4 = self.cfg, self.ops, self.l4
        eps = cfg.rms_norm_eps
        hidden = F.embedding(input_ids, self.embed) if inputs_embeds is None else inputs_embeds
        tuning = None
        if l4.temperature_tuning is not None and not all(l4.rope_layers):
            floor_scale, attn_scale = l4.temperature_tuning
            tuning = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
        residual: torch.Tensor | None = None
        for i, layer, window, cos_sin, kv_cache, scales in self._per_layer(kv_caches):
            x, residual = ops.rms_norm(hidden, layer["in_norm"], eps, residual)
            if residual is None:
                residual = hidden
            q, k, v = split_heads(self._project(i, "qkv", x, layer["qkv"], layer["qkv_bias"]), cfg)
            if cos_sin is not None:
                q, k = apply_rope(ops, positions, q, k, cos_sin, self.rotary_dim, True)
                if l4.use_qk_norm:
                    q, k = head_norm(ops, q, self.qk_ones, eps), head_norm(ops, k, self.qk_ones, eps)
            elif tuning is not None:
                q = (q * tuning[:, None, None]).to(q.dtype)
            hidden = self._attend(i, layer, q, k, v, kv_cache, scales, meta, window, chunk=self.chunks[i])
            x, residual = ops.rms_norm(hidden, layer["post_norm"], eps, residual)
            hidden = self._moe(layer, x) if "router" in layer else self._swiglu(i, layer, x)
        out, _ = ops.rms_norm(hidden, self.norm, eps, residual)
        return out

    def _moe(self, layer: Layer, x: torch.Tensor) -> torch.Tensor:
        """The shared expert plus the routed ones. Each token's top-k experts by router logit each
        take the token times ``sigmoid(logit)`` (in the model dtype, as transformers rounds it) and
        add their outputs unweighted; slots are summed in ascending expert order, transformers'."""
        linear, silu_and_mul = self.linear, self.ops.silu_and_mul
        logits = linear(x, layer["router"], None)
        top, experts = logits.topk(self.l4.experts_per_token, dim=-1)
        experts, order = experts.sort(dim=-1)
        scores = self.sigmoid(top.gather(1, order).float()).to(x.dtype)
        out = linear(silu_and_mul(linear(x, layer["shared_gate_up"], None)), layer["shared_down"], None)
        w13, w2 = layer["w13"], layer["w2"]

        def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
            return linear(silu_and_mul(linear(rows, w13[e], None)), w2[e], None)

        ones = torch.ones_like(scores[:, :1], dtype=torch.float32)  # the scores went into the inputs
        for j in range(experts.shape[1]):
            xs, slot = x * scores[:, j : j + 1], experts[:, j : j + 1]
            if self.ops.fused_moe is not None:  # the Triton op set's grouped matmuls
                out = out + self.ops.fused_moe(xs, w13, w2, ones, slot, silu_and_mul)
            else:
                out = out + run_experts(xs, ones, slot, self.l4.num_experts, expert)
        return out
