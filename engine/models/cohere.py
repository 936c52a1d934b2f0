"""Cohere Command R / R+ (``CohereForCausalLM``) and Command R7B / A (``Cohere2ForCausalLM``) decoders
over the paged KV cache.

A layer runs attention and the SwiGLU MLP side by side on one LayerNorm (without bias) of its input:
``h = h + attn(norm(h)) + mlp(norm(h))``. Rotary turns interleaved pairs (x0, x1), (x2, x3)…
(``rope_interleave``, done as GLM-4's); ``use_qk_norm`` LayerNorms q and k per head, each head with
its own weight, before rotary. The logits are multiplied by ``logit_scale``. Cohere 2 mixes sliding
and full layers (``layer_types``); its full layers have no rotary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionMetadata
from engine.models.decoder import DecoderBase, KVCache, Layer, apply_rope, split_heads
from engine.models.moe import load_dense_mlp


def head_layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm of ``x`` [T, H, D] over each head's D dims, scaled by ``weight`` [H, D] (a weight per
    head), in fp32 and returned in ``x``'s dtype, as transformers' CohereLayerNorm of q/k."""
    normed = F.layer_norm(x.float(), (x.shape[-1],), None, None, eps)
    return (weight.float() * normed).to(x.dtype)


class CohereForCausalLM(DecoderBase):
    def _setup(self, w: dict[str, torch.Tensor]) -> None:
        if self.cfg.hidden_act != "silu":
            raise ValueError(f"Cohere with hidden_act {self.cfg.hidden_act!r} is not supported (only silu)")

    @staticmethod
    def _layer(w: dict[str, torch.Tensor], i: int) -> Layer:
        p = f"model.layers.{i}."
        a = p + "self_attn."
        bias = None
        if a + "q_proj.bias" in w:  # attention_bias
            bias = torch.cat([w.pop(a + f"{x}_proj.bias") for x in "qkv"])
        layer: Layer = {
            "norm": w.pop(p + "input_layernorm.weight"),
            "qkv": torch.cat([w.pop(a + f"{x}_proj.weight") for x in "qkv"]),
            "qkv_bias": bias,
            "o": w.pop(a + "o_proj.weight"),
            "o_bias": w.pop(a + "o_proj.bias", None),
        }
        if a + "q_norm.weight" in w:  # use_qk_norm: [heads, head_dim] weights
            layer["q_norm"], layer["k_norm"] = w.pop(a + "q_norm.weight"), w.pop(a + "k_norm.weight")
        layer.update(load_dense_mlp(w, p + "mlp."))
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
        cfg, ops = self.cfg, self.ops
        eps = cfg.rms_norm_eps
        hidden = F.embedding(input_ids, self.embed) if inputs_embeds is None else inputs_embeds
        for i, layer, window, cos_sin, kv_cache, scales in self._per_layer(kv_caches):
            x = ops.layer_norm(hidden, layer["norm"], None, eps)[0]
            q, k, v = split_heads(self._project(i, "qkv", x, layer["qkv"], layer["qkv_bias"]), cfg)
            if "q_norm" in layer:
                q, k = head_layer_norm(q, layer["q_norm"], eps), head_layer_norm(k, layer["k_norm"], eps)
            if cos_sin is not None:  # Cohere 2's full layers have none
                q, k = apply_rope(ops, positions, q, k, cos_sin, cfg.head_dim, True)
            attn_out = self._attend(i, layer, q, k, v, kv_cache, scales, meta, window)
            mlp_out = self._swiglu(i, layer, x)
            hidden = hidden + attn_out + mlp_out  # transformers' order: (residual + attn) + mlp
        return ops.layer_norm(hidden, self.norm, None, eps)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[N, vocab]`` times ``logit_scale``, for the rows that need them."""
        return super().compute_logits(hidden) * self.cfg.logit_scale
