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

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.lora import LoRABatch, ModuleSlot
from engine.models.config import ModelConfig
from engine.models.kv_scales import KVScales, layer_scales
from engine.models.llama import (
    Linear,
    apply_rope,
    dense_lora_layout,
    invariant_linear,
    layer_cos_sin,
    split_heads,
)
from engine.models.moe import load_dense_mlp
from engine.ops import Ops


def head_layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm of ``x`` [T, H, D] over each head's D dims, scaled by ``weight`` [H, D] (a weight per
    head), in fp32 and returned in ``x``'s dtype, as transformers' CohereLayerNorm of q/k."""
    normed = F.layer_norm(x.float(), (x.shape[-1],), None, None, eps)
    return (weight.float() * normed).to(x.dtype)


class CohereForCausalLM:
    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        *,
        ops: Ops,
        attention: AttentionBackend,
        deterministic: bool,
        max_positions: int,
        device: torch.device,
        kv_scales: KVScales | None = None,
    ) -> None:
        if cfg.hidden_act != "silu":
            raise ValueError(f"Cohere with hidden_act {cfg.hidden_act!r} is not supported (only silu)")
        self.cfg = cfg
        self.ops = ops
        self.attention = attention
        self.linear: Linear = invariant_linear if deterministic else F.linear
        self.scale = cfg.head_dim**-0.5
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.cos_sin = layer_cos_sin(cfg, cfg.head_dim, max_positions, device)
        self.windows = cfg.layer_windows or (None,) * cfg.num_layers
        self.embed = weights.pop("model.embed_tokens.weight")
        self.norm = weights.pop("model.norm.weight")
        head = weights.pop("lm_head.weight", None)
        self.lm_head = self.embed if cfg.tie_word_embeddings or head is None else head
        self.layers = [self._layer(weights, i) for i in range(cfg.num_layers)]
        self.kv_scales = layer_scales(kv_scales, cfg.num_layers)  # the fp8 cache's (k, v) scales
        # The step's LoRA adapters (engine/lora.py), set by the model runner before each forward.
        self.lora: LoRABatch | None = None

    def lora_layout(self) -> list[dict[str, ModuleSlot]]:
        return dense_lora_layout(self.layers, self.q_size, self.kv_size, self.cfg.hidden_size)

    @staticmethod
    def _layer(w: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor | None]:
        p = f"model.layers.{i}."
        a = p + "self_attn."
        bias = None
        if a + "q_proj.bias" in w:  # attention_bias
            bias = torch.cat([w.pop(a + f"{x}_proj.bias") for x in "qkv"])
        layer: dict[str, torch.Tensor | None] = {
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

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden]: instead of the ids' embeddings
    ) -> torch.Tensor:
        """Hidden states after the final norm, ``[T, hidden]``."""
        cfg, ops, linear, lora = self.cfg, self.ops, self.linear, self.lora
        eps, t = cfg.rms_norm_eps, input_ids.shape[0]
        hidden = F.embedding(input_ids, self.embed) if inputs_embeds is None else inputs_embeds
        layers = zip(self.layers, self.windows, self.cos_sin, kv_caches, self.kv_scales, strict=True)
        for i, (layer, window, cos_sin, (k_cache, v_cache), (k_scale, v_scale)) in enumerate(layers):
            x = ops.layer_norm(hidden, layer["norm"], None, eps)[0]
            qkv = linear(x, layer["qkv"], layer["qkv_bias"])  # type: ignore[arg-type]
            if lora is not None:
                lora.add(i, "qkv", x, qkv)
            q, k, v = split_heads(qkv, cfg)
            if "q_norm" in layer:
                q = head_layer_norm(q, layer["q_norm"], eps)  # type: ignore[arg-type]
                k = head_layer_norm(k, layer["k_norm"], eps)  # type: ignore[arg-type]
            if cos_sin is not None:  # Cohere 2's full layers have none
                q, k = apply_rope(ops, positions, q, k, cos_sin, cfg.head_dim, True)
            attn = self.attention.forward(
                q.contiguous(),
                k.contiguous(),
                v.contiguous(),
                k_cache,
                v_cache,
                meta,
                self.scale,
                window,
                k_scale=k_scale,
                v_scale=v_scale,
            ).reshape(t, self.q_size)
            attn_out = linear(attn, layer["o"], layer["o_bias"])  # type: ignore[arg-type]
            if lora is not None:
                lora.add(i, "o", attn, attn_out)
            gate_up = linear(x, layer["gate_up"], None)  # type: ignore[arg-type]
            if lora is not None:
                lora.add(i, "gate_up", x, gate_up)
            act = ops.silu_and_mul(gate_up)
            mlp_out = linear(act, layer["down"], None)  # type: ignore[arg-type]
            if lora is not None:
                lora.add(i, "down", act, mlp_out)
            hidden = hidden + attn_out + mlp_out  # transformers' order: (residual + attn) + mlp
        return ops.layer_norm(hidden, self.norm, None, eps)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[N, vocab]`` times ``logit_scale``, for the rows that need them."""
        logits = self.linear(hidden, self.lm_head, None).float()
        return logits * self.cfg.logit_scale
