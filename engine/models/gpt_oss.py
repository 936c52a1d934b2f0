"""OpenAI's gpt-oss (``GptOssForCausalLM``: gpt-oss-20b, gpt-oss-120b) over the paged KV cache.

Differences from the Llama family, all as transformers computes them:
* attention sinks: a learned logit per query head joins each softmax as one more column with no
  value (the attention backends take it as ``sinks``);
* sliding-window (``sliding_attention``) and full layers alternate (``ModelConfig.layer_windows``);
* q/k/v and o projections with biases; YaRN rotary (``truncate`` as the config says);
* every MLP is a mixture of experts: a router with a bias picks the top-k logits and softmaxes
  them; the experts have biases and a clamped SwiGLU, ``(clamp(up, ±limit) + 1) * g * sigmoid(alpha
  * g)`` with ``g = min(gate, limit)``. Checkpoints store the experts fused (``gate_up_proj``
  ``[E, hidden, 2I]`` with gate and up interleaved column by column, ``down_proj`` ``[E, I, hidden]``),
  in the model dtype or MXFP4 (``engine/models/quantized.py`` dequantizes those at load).

The experts run one matmul pair per expert over its tokens (``moe.run_experts``); ferry's Triton
grouped-matmul MoE kernel has neither biases nor this activation, so it is not used here.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionMetadata
from engine.models.config import ModelConfig
from engine.models.decoder import DecoderBase, KVCache, Layer, split_heads
from engine.models.moe import run_experts


class GptOssForCausalLM(DecoderBase):
    """A LoRA adapter reaches attention's projections (``lora_layout`` lists no expert)."""

    # Sinks are added to fp32 scores; holding them in fp32 loses nothing of a bf16 checkpoint's.
    FP32_WEIGHTS = ("self_attn.sinks",)

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], **options: Any) -> None:
        if cfg.moe is None or cfg.swiglu is None:
            raise ValueError(f"{cfg.architecture} needs a gpt_oss config (num_local_experts, swiglu_limit)")
        self.alpha, self.limit = cfg.swiglu
        self.top_k = cfg.moe.experts_per_token
        super().__init__(cfg, weights, **options)

    @staticmethod
    def _layer(w: dict[str, torch.Tensor], i: int) -> Layer:
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."

        def qkv(part: str) -> torch.Tensor:
            return torch.cat([w.pop(f"{a}{x}_proj.{part}") for x in "qkv"])

        # [E, hidden, 2I] -> [E, 2I, hidden] (linear's layout), gate rows first, then up rows.
        gate_up = w.pop(m + "experts.gate_up_proj").transpose(1, 2)
        gate_up_bias = w.pop(m + "experts.gate_up_proj_bias")
        return {
            "in_norm": w.pop(p + "input_layernorm.weight"),
            "qkv": qkv("weight"),
            "qkv_bias": qkv("bias"),
            "o": w.pop(a + "o_proj.weight"),
            "o_bias": w.pop(a + "o_proj.bias"),
            "sinks": w.pop(a + "sinks").float(),
            "post_norm": w.pop(p + "post_attention_layernorm.weight"),
            "router": w.pop(m + "router.weight"),
            "router_bias": w.pop(m + "router.bias"),
            "w13": torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1),
            "w13_bias": torch.cat([gate_up_bias[:, 0::2], gate_up_bias[:, 1::2]], dim=1),
            "w2": w.pop(m + "experts.down_proj").transpose(1, 2).contiguous(),  # [E, hidden, I]
            "w2_bias": w.pop(m + "experts.down_proj_bias"),
        }

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden]: instead of ``embed_tokens(input_ids)``
    ) -> torch.Tensor:
        """Hidden states after the final norm, ``[T, hidden]``."""
        cfg, ops = self.cfg, self.ops
        eps = cfg.rms_norm_eps
        hidden = F.embedding(input_ids, self.embed) if inputs_embeds is None else inputs_embeds
        residual: torch.Tensor | None = None
        for i, layer, window, cos_sin, kv_cache, scales in self._per_layer(kv_caches):
            x, residual = ops.rms_norm(hidden, layer["in_norm"], eps, residual)
            if residual is None:
                residual = hidden
            q, k, v = split_heads(self._project(i, "qkv", x, layer["qkv"], layer["qkv_bias"]), cfg)
            q, k = q.contiguous(), k.contiguous()
            ops.rotary_embedding(positions, q, k, cos_sin)
            hidden = self._attend(i, layer, q, k, v, kv_cache, scales, meta, window, sinks=layer["sinks"])
            x, residual = ops.rms_norm(hidden, layer["post_norm"], eps, residual)
            hidden = self._experts(x, layer)
        out, _ = ops.rms_norm(hidden, self.norm, eps, residual)
        return out

    def _experts(self, x: torch.Tensor, layer: dict[str, torch.Tensor]) -> torch.Tensor:
        linear, limit, alpha = self.linear, self.limit, self.alpha
        logits = linear(x, layer["router"], layer["router_bias"])
        top, experts = logits.topk(self.top_k, dim=-1)
        weights = top.softmax(dim=-1)
        w13, b13, w2, b2 = layer["w13"], layer["w13_bias"], layer["w2"], layer["w2_bias"]

        def expert(e: int, xs: torch.Tensor) -> torch.Tensor:
            gate, up = linear(xs, w13[e], b13[e]).chunk(2, dim=-1)
            gate = gate.clamp(max=limit)
            up = up.clamp(min=-limit, max=limit)
            return linear((up + 1) * (gate * torch.sigmoid(gate * alpha)), w2[e], b2[e])

        return run_experts(x, weights, experts, self.cfg.moe.num_experts, expert)  # type: ignore[union-attr]
