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
from engine.ops import Ops

# transformers' ACT2FN names of the activations an ungated MLP may use.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
}

Layer = dict[str, torch.Tensor | None]


class Starcoder2ForCausalLM:
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
        if cfg.hidden_act not in ACTIVATIONS:
            raise ValueError(f"StarCoder2 with hidden_act {cfg.hidden_act!r} is not supported")
        self.act = ACTIVATIONS[cfg.hidden_act]
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
        self.norm_bias = weights.pop("model.norm.bias", None)
        head = weights.pop("lm_head.weight", None)
        self.lm_head = self.embed if cfg.tie_word_embeddings or head is None else head
        self.layers = [self._layer(weights, i) for i in range(cfg.num_layers)]
        self.kv_scales = layer_scales(kv_scales, cfg.num_layers)  # the fp8 cache's (k, v) scales
        # The step's LoRA adapters (engine/lora.py), set by the model runner before each forward.
        self.lora: LoRABatch | None = None

    def lora_layout(self) -> list[dict[str, ModuleSlot]]:
        """Attention's projections (the MLP's c_fc / c_proj take no adapter)."""
        return dense_lora_layout(self.layers, self.q_size, self.kv_size, self.cfg.hidden_size)

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
        residual: torch.Tensor | None = None
        layers = zip(self.layers, self.windows, self.cos_sin, kv_caches, self.kv_scales, strict=True)
        for i, (layer, window, cos_sin, (k_cache, v_cache), (k_scale, v_scale)) in enumerate(layers):
            x, residual = ops.layer_norm(hidden, layer["in_norm"], layer["in_norm_bias"], eps, residual)
            if residual is None:
                residual = hidden
            qkv = linear(x, layer["qkv"], layer["qkv_bias"])  # type: ignore[arg-type]
            if lora is not None:
                lora.add(i, "qkv", x, qkv)
            q, k, v = split_heads(qkv, cfg)
            q, k = apply_rope(ops, positions, q, k, cos_sin, cfg.head_dim, False)
            attn = self.attention.forward(
                q,
                k,
                v.contiguous(),
                k_cache,
                v_cache,
                meta,
                self.scale,
                window,
                k_scale=k_scale,
                v_scale=v_scale,
            ).reshape(t, self.q_size)
            hidden = linear(attn, layer["o"], layer["o_bias"])  # type: ignore[arg-type]
            if lora is not None:
                lora.add(i, "o", attn, hidden)
            x, residual = ops.layer_norm(hidden, layer["post_norm"], layer["post_norm_bias"], eps, residual)
            hidden = linear(
                self.act(linear(x, layer["fc"], layer["fc_bias"])), layer["proj"], layer["proj_bias"]
            )  # type: ignore[arg-type]
        out, _ = ops.layer_norm(hidden, self.norm, self.norm_bias, eps, residual)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[N, vocab]`` for the rows that need them."""
        return self.linear(hidden, self.lm_head, None).float()
