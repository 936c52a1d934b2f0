"""Phi-3.5-MoE (``PhimoeForCausalLM``) over the paged KV cache, as transformers 5 computes it.

Llama's layout with LayerNorms (mean subtracted, with bias) for norms, biases on q/k/v/o (and on the
LM head with ``lm_head_bias``), longrope rotary (``config_phimoe.py``: the short factors and one
mscale), an optional sliding window on every layer, and every MLP a mixture of Mixtral-style experts
(w1/w3 gate and up, w2 down) behind the sparsemixer router: at inference it is deterministic, each
token's best expert weighted by the softmax of the logits within ``2 * router_jitter_noise`` (relative)
of the best, then the best of the rest likewise among the logits near it. It always picks two experts
whatever ``num_experts_per_tok`` says, as transformers does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionMetadata
from engine.models.config import ModelConfig
from engine.models.decoder import DecoderBase, KVCache, Layer, apply_rope, split_heads
from engine.models.moe import MoE
from engine.models.rope import longrope_inv_freq, rope_rows


class SparsemixerMoE(MoE):
    """``MoE``'s experts (one matmul pair each, or the Triton grouped matmuls) with sparsemixer's
    routing; the router runs in the model dtype, as transformers' ``nn.Linear`` does."""

    def __init__(self, *args: Any, jitter_eps: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.jitter_eps = jitter_eps

    def route(self, x: torch.Tensor, layer: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.linear(x, layer["router"], None)
        first, w1 = self._pick(scores, scores)
        rest = scores.scatter(-1, first, float("-inf"))
        second, w2 = self._pick(scores, rest)
        return torch.cat([w1, w2], dim=-1).float(), torch.cat([first, second], dim=-1)

    def _pick(self, scores: torch.Tensor, candidates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The best of ``candidates`` and its weight: the softmax over the candidates whose gap to it,
        relative to ``max(|score|, best)``, is at most ``2 * jitter_eps``."""
        best, index = candidates.max(dim=-1, keepdim=True)
        far = (best - scores) / scores.abs().clamp(min=best) > 2 * self.jitter_eps
        gates = candidates.masked_fill(far, float("-inf")).softmax(dim=-1)
        return index, gates.gather(-1, index)


class PhimoeForCausalLM(DecoderBase):
    """LoRA adapters reach attention's projections (the experts take none)."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], **options: Any) -> None:
        if cfg.phimoe is None or cfg.moe is None:
            raise ValueError(f"{cfg.architecture} needs a phimoe config")
        if cfg.moe.num_experts < 2:
            raise ValueError("sparsemixer picks two experts: num_local_experts must be at least 2")
        if cfg.hidden_act != "silu":
            raise ValueError(f"Phi-3.5-MoE with hidden_act {cfg.hidden_act!r} is not supported (silu only)")
        self.phimoe = cfg.phimoe
        super().__init__(cfg, weights, **options)

    def _rotary_tables(self, max_positions: int, device: torch.device) -> list[torch.Tensor | None]:
        """Longrope's short-factor rows at every position (transformers' ``PhimoeRotaryEmbedding``
        never takes the long factors, unlike Phi-3's longrope in ``rope.longrope_cache``), cos and sin
        times the mscale."""
        if not self.phimoe.short_factor:
            return super()._rotary_tables(max_positions, device)
        short = self.phimoe.short_factor
        freqs = longrope_inv_freq(self.rotary_dim, self.cfg.rope_theta, short, "short_factor")
        table = rope_rows(freqs, 0, max_positions, self.phimoe.mscale).to(device)
        return [table] * self.cfg.num_layers

    def _setup(self, w: dict[str, torch.Tensor]) -> None:
        ops = self.ops
        self.moe = SparsemixerMoE(
            self.cfg.moe,
            self.linear,
            ops.silu_and_mul,
            ops.fused_moe,
            deterministic=self.deterministic,
            jitter_eps=self.phimoe.jitter_eps,
        )
        self.norm_bias = w.pop("model.norm.bias", None)
        self.lm_head_bias = w.pop("lm_head.bias", None)

    def _layer(self, w: dict[str, torch.Tensor], i: int) -> Layer:
        p = f"model.layers.{i}."
        a = p + "self_attn."
        qkv_bias = None
        if a + "q_proj.bias" in w:
            qkv_bias = torch.cat([w.pop(a + f"{x}_proj.bias") for x in "qkv"])
        m = p + ("block_sparse_moe." if p + "block_sparse_moe.gate.weight" in w else "mlp.")
        if m + "router.weight" in w:  # transformers' in-memory name
            w[m + "gate.weight"] = w.pop(m + "router.weight")
        dtype = w[m + "gate.weight"].dtype
        layer = {
            "in_norm": w.pop(p + "input_layernorm.weight"),
            "in_norm_bias": w.pop(p + "input_layernorm.bias", None),
            "qkv": torch.cat([w.pop(a + f"{x}_proj.weight") for x in "qkv"]),
            "qkv_bias": qkv_bias,
            "o": w.pop(a + "o_proj.weight"),
            "o_bias": w.pop(a + "o_proj.bias", None),
            "post_norm": w.pop(p + "post_attention_layernorm.weight"),
            "post_norm_bias": w.pop(p + "post_attention_layernorm.bias", None),
            **self.moe.load(w, m),
        }
        layer["router"] = layer["router"].to(dtype)  # MoE.load keeps routers in fp32; this one is not
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
        residual: torch.Tensor | None = None
        for i, layer, window, cos_sin, kv_cache, scales in self._per_layer(kv_caches):
            x, residual = ops.layer_norm(hidden, layer["in_norm"], layer["in_norm_bias"], eps, residual)
            if residual is None:
                residual = hidden
            q, k, v = split_heads(self._project(i, "qkv", x, layer["qkv"], layer["qkv_bias"]), cfg)
            q, k = apply_rope(ops, positions, q, k, cos_sin, self.rotary_dim, False)  # type: ignore[arg-type]
            hidden = self._attend(i, layer, q, k, v, kv_cache, scales, meta, window)
            x, residual = ops.layer_norm(hidden, layer["post_norm"], layer["post_norm_bias"], eps, residual)
            hidden = self.moe.forward(x, layer)
        out, _ = ops.layer_norm(hidden, self.norm, self.norm_bias, eps, residual)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[N, vocab]``, with the head's bias (``lm_head_bias``)."""
        return self.linear(hidden, self.lm_head, self.lm_head_bias).float()
