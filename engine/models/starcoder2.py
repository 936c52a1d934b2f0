"""StarCoder2 decoder (``Starcoder2ForCausalLM``) over the paged KV cache.

Llama's layout (a norm before attention and before the MLP, GQA, rotary over whole heads) with
LayerNorms (mean subtracted, with bias) for norms, a bias on every projection (``use_bias``), an
ungated MLP ``c_proj(act(c_fc(x)))`` (``gelu_pytorch_tanh`` in the releases) and one sliding window on
every layer when the config sets one. Embeddings are tied by default.
"""

from __future__ import annotations

import torch

from engine.models.decoder import Layer
from engine.models.layernorm_decoder import LayerNormDecoder


class Starcoder2ForCausalLM(LayerNormDecoder):
    """LoRA adapters reach attention's projections (the MLP's c_fc / c_proj take none). The forward
    is ``LayerNormDecoder``'s, its sequential residual."""

    def _residual_style(self) -> str:
        return "sequential"

    @staticmethod
    def _layer(w: dict[str, torch.Tensor], i: int) -> Layer:
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        qkv = torch.cat([w.pop(a + f"{x}_proj.weight") for x in "qkv"])
        qkv_bias = None
        if a + "q_proj.bias" in w:
            qkv_bias = torch.cat([w.pop(a + f"{x}_proj.bias") for x in "qkv"])
        return {
            "in_norm": w.pop(p + "input_layernorm.weight"),
            "in_norm_bias": w.pop(p + "input_layernorm.bias", None),
            "qkv": qkv,
            "qkv_bias": qkv_bias,
            "o": w.pop(a + "o_proj.weight"),
            "o_bias": w.pop(a + "o_proj.bias", None),
            "post_norm": w.pop(p + "post_attention_layernorm.weight"),
            "post_norm_bias": w.pop(p + "post_attention_layernorm.bias", None),
            "fc": w.pop(m + "c_fc.weight"),
            "fc_bias": w.pop(m + "c_fc.bias", None),
            "proj": w.pop(m + "c_proj.weight"),
            "proj_bias": w.pop(m + "c_proj.bias", None),
        }
