"""Llama-family decoder over the paged KV cache: Llama 2/3, Mistral, Qwen2 (q/k/v bias), Qwen3
(per-head RMSNorm of q and k before rotary), Qwen3-MoE and Mixtral (mixture-of-experts MLPs), Phi-3
(fused qkv and gate_up weights, partial rotary), GLM-4.5 (q/k/v bias, partial rotary, optional q/k
norm, DeepSeek-V3's router and shared experts), Granite and Granite-MoE (embedding, attention, residual
and logit multipliers), Seed-OSS (q/k/v bias), SmolLM3 (layers without rotary), GLM-4-0414 (norms
after attention and MLP too, rotary in interleaved pairs), ERNIE 4.5 and its MoE (interleaved rotary;
a softmax router with a correction bias), Hunyuan dense (q/k norm after rotary), MiniMax-M2 (q/k norm
over all heads, partial rotary, a sigmoid router with a correction bias), OLMoE (q/k norm over all
heads, a softmax top-k router over every layer's experts), GLM-4-9B (GLM-4-0414 without its extra
norms), Helium (whole heads rotated in interleaved pairs), Ministral (sliding and full layers by
``layer_types``) and Ministral 3 (YaRN; queries scaled by Llama 4's attention temperature, which grows
with the position past the original context).

Helium's RMSNorm multiplies by its weight in fp32 before casting back, Llama's after: the same in
fp32, a last-bit difference in bf16.

Weights are held as plain tensors with q/k/v and gate/up fused into one matmul each; the frame
(construction, attention through o_proj, LoRA, the head) is ``engine/models/decoder.py``'s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionMetadata
from engine.models.decoder import (
    DecoderBase,
    KVCache,
    Layer,
    apply_rope,
    head_norm,
    split_heads,
)
from engine.models.moe import MoE, load_dense_mlp


class LlamaForCausalLM(DecoderBase):
    # MoE routers that checkpoints store in fp32 (GLM-4.5, ERNIE 4.5) stay fp32, as transformers keeps them.
    FP32_WEIGHTS = (
        "mlp.gate.weight",
        "mlp.gate.e_score_correction_bias",
        "mlp.moe_statics.e_score_correction_bias",  # ERNIE 4.5's name
        "block_sparse_moe.e_score_correction_bias",  # MiniMax-M2's
    )

    def _attention_scale(self) -> float:
        return self.cfg.attention_multiplier or self.cfg.head_dim**-0.5  # Granite's multiplier

    def _setup(self, w: dict[str, torch.Tensor]) -> None:
        moe, ops = self.cfg.moe, self.ops
        self.moe = (
            None
            if moe is None
            else MoE(moe, self.linear, ops.silu_and_mul, ops.fused_moe, deterministic=self.deterministic)
        )

    def _layer(self, w: dict[str, torch.Tensor], i: int) -> Layer:
        p = f"model.layers.{i}."
        a = p + "self_attn."
        bias = None
        if a + "qkv_proj.weight" in w:  # Phi-3 stores q/k/v fused
            qkv, bias = w[a + "qkv_proj.weight"], w.get(a + "qkv_proj.bias")
        else:
            qkv = torch.cat([w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]])
        if a + "q_proj.bias" in w:
            bias = torch.cat([w[a + "q_proj.bias"], w[a + "k_proj.bias"], w[a + "v_proj.bias"]])
        # Mixtral's and MiniMax-M2's name for the MoE block (gate.weight), and Granite-MoE's (its
        # checkpoints' router.layer, transformers' in-memory router: --load-format dummy's names).
        moe_block = tuple(
            p + "block_sparse_moe." + name for name in ("gate.weight", "router.layer.weight", "router.weight")
        )
        m = p + ("block_sparse_moe." if any(name in w for name in moe_block) else "mlp.")
        layer = {
            "in_norm": w[p + "input_layernorm.weight"],
            "qkv": qkv,
            "qkv_bias": bias,
            "o": w[a + "o_proj.weight"],
            "o_bias": w.get(a + "o_proj.bias"),
            "post_norm": w[p + "post_attention_layernorm.weight"],
        }
        if p + "post_self_attn_layernorm.weight" in w:  # GLM-4: also norms after attention and MLP
            layer["attn_out_norm"] = w[p + "post_self_attn_layernorm.weight"]
            layer["mlp_out_norm"] = w[p + "post_mlp_layernorm.weight"]
        if a + "q_norm.weight" in w:  # Qwen3
            layer["q_norm"], layer["k_norm"] = w[a + "q_norm.weight"], w[a + "k_norm.weight"]
        if a + "query_layernorm.weight" in w:  # Hunyuan: the same per-head norms, after rotary
            layer["q_norm_roped"] = w[a + "query_layernorm.weight"]
            layer["k_norm_roped"] = w[a + "key_layernorm.weight"]
        moe = self.moe is not None and self.moe.cfg.is_moe_layer(i)
        layer.update(self.moe.load(w, m) if moe else self._load_mlp(w, m))  # type: ignore[union-attr]
        return layer

    # A dense layer's MLP weights at ``….mlp.`` (SwiGLU's; Arcee's subclass loads its ungated MLP).
    _load_mlp = staticmethod(load_dense_mlp)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden]: instead of the ids' embeddings
    ) -> torch.Tensor:
        """Hidden states after the final norm, ``[T, hidden]``."""
        cfg, ops = self.cfg, self.ops
        eps = cfg.rms_norm_eps
        hidden = F.embedding(input_ids, self.embed) if inputs_embeds is None else inputs_embeds
        if cfg.embedding_multiplier != 1.0:
            hidden = hidden * cfg.embedding_multiplier
        scale_out = cfg.residual_multiplier != 1.0  # Granite scales each block's output
        residual: torch.Tensor | None = None
        query_scale = None
        if cfg.query_position_scale is not None:  # fp32, as transformers computes it, then q's dtype
            beta, original = cfg.query_position_scale
            steps = torch.floor(positions / original)
            query_scale = (1 + beta * torch.log(1 + steps)).to(hidden.dtype)[:, None, None]
        for i, layer, window, cos_sin, kv_cache, scales in self._per_layer(kv_caches):
            x, residual = ops.rms_norm(hidden, layer["in_norm"], eps, residual)
            if residual is None:
                residual = hidden
            q, k, v = split_heads(self._project(i, "qkv", x, layer["qkv"], layer["qkv_bias"]), cfg)
            if "q_norm" in layer:  # before rotary
                q, k = head_norm(ops, q, layer["q_norm"], eps), head_norm(ops, k, layer["k_norm"], eps)
            if cos_sin is not None:
                q, k = apply_rope(ops, positions, q, k, cos_sin, self.rotary_dim, cfg.rope_interleave)
            if query_scale is not None:  # Ministral 3: q only, after rotary
                q = q * query_scale
            if "q_norm_roped" in layer:  # Hunyuan: after rotary
                q = head_norm(ops, q, layer["q_norm_roped"], eps)
                k = head_norm(ops, k, layer["k_norm_roped"], eps)
            hidden = self._attend(i, layer, q, k, v, kv_cache, scales, meta, window)
            if scale_out:
                hidden = hidden * cfg.residual_multiplier
            if "attn_out_norm" in layer:  # GLM-4's sandwich: the block's output normed before the add
                hidden = ops.rms_norm(hidden, layer["attn_out_norm"], eps)[0]
            x, residual = ops.rms_norm(hidden, layer["post_norm"], eps, residual)
            hidden = self._mlp(i, layer, x)
            if scale_out:
                hidden = hidden * cfg.residual_multiplier
            if "mlp_out_norm" in layer:
                hidden = ops.rms_norm(hidden, layer["mlp_out_norm"], eps)[0]
        out, _ = ops.rms_norm(hidden, self.norm, eps, residual)
        return out

    def _mlp(self, i: int, layer: Layer, x: torch.Tensor) -> torch.Tensor:
        """Layer ``i``'s MLP (experts or SwiGLU) of its normed input ``x``; subclasses with another MLP
        (Arcee's ReLU^2) override it."""
        if "router" in layer:
            return self.moe.forward(x, layer)  # type: ignore[union-attr]
        return self._swiglu(i, layer, x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[N, vocab]`` for the rows that need them (never the whole batch)."""
        logits = super().compute_logits(hidden)
        return logits / self.cfg.logits_scaling if self.cfg.logits_scaling != 1.0 else logits
