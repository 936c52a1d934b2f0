"""StarCoder2 decoder (``Starcoder2ForCausalLM``) over the paged KV cache.

Llama's layout (a norm before attention and before the MLP, GQA, rotary over whole heads) with
LayerNorms (mean subtracted, with bias) for norms, a bias on every projection (``use_bias``), an
ungated MLP ``c_proj(act(c_fc(x)))`` (``gelu_pytorch_tanh`` in the releases) and one sliding window on
every layer when the config sets one. Embeddings are tied by default.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionMetadata
from engine.models.decoder import DecoderBase, KVCache, Layer, apply_rope, split_heads

# transformers' ACT2FN names of the activations an ungated MLP may use.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
}


class Starcoder2ForCausalLM(DecoderBase):
    """LoRA adapters reach attention's projections (the MLP's c_fc / c_proj take none)."""

    def _setup(self, w: dict[str, torch.Tensor]) -> None:
        if self.cfg.hidden_act not in ACTIVATIONS:
            raise ValueError(f"StarCoder2 with hidden_act {self.cfg.hidden_act!r} is not supported")
        self.act = ACTIVATIONS[self.cfg.hidden_act]
        self.norm_bias = w.pop("model.norm.bias", None)

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

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden]: instead of the ids' embeddings
    ) -> torch.Tensor:
        """Hidden states after the final norm, ``[T, hidden]``."""
        cfg, ops, linear = self.cfg, self.ops, self.linear
        eps = cfg.rms_norm_eps
        hidden = F.embedding(input_ids, self.embed) if inputs_embeds is None else inputs_embeds
        residual: torch.Tensor | None = None
        for i, layer, window, cos_sin, kv_cache, scales in self._per_layer(kv_caches):
            x, residual = ops.layer_norm(hidden, layer["in_norm"], layer["in_norm_bias"], eps, residual)
            if residual is None:
                residual = hidden
            q, k, v = split_heads(self._project(i, "qkv", x, layer["qkv"], layer["qkv_bias"]), cfg)
            q, k = apply_rope(ops, positions, q, k, cos_sin, self.rotary_dim, False)  # type: ignore[arg-type]
            hidden = self._attend(i, layer, q, k, v, kv_cache, scales, meta, window)
            x, residual = ops.layer_norm(hidden, layer["post_norm"], layer["post_norm_bias"], eps, residual)
            hidden = linear(
                self.act(linear(x, layer["fc"], layer["fc_bias"])), layer["proj"], layer["proj_bias"]
            )
        out, _ = ops.layer_norm(hidden, self.norm, self.norm_bias, eps, residual)
        return out
