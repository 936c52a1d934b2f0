"""OLMo 2, OLMo 3 and EXAONE 4 decoders (``Olmo2ForCausalLM``, ``Olmo3ForCausalLM``,
``Exaone4ForCausalLM``) over the paged KV cache.

Unlike the Llama family, OLMo 2 normalises after each block instead of before it: a layer is
``h = h + norm(attn(h))`` then ``h = h + norm(mlp(h))``, and q and k are RMS-normalised over their
whole projection (all heads at once) before rotary. Everything else (GQA, SwiGLU, rotary, the final
norm) is Llama's, as transformers computes it. OLMo 3 adds sliding-window layers (``layer_types``),
each layer type with its own rope (transformers 5 scales only the full-attention layers' rope).
EXAONE 4 is OLMo 3 with q and k normalised per head (Qwen3's way) and, with a sliding window, no
rotary on its full-attention layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.lora import LoRABatch, ModuleSlot
from engine.models.config import ModelConfig
from engine.models.kv_scales import KVScales, layer_scales
from engine.models.llama import Linear, dense_lora_layout, invariant_linear, layer_cos_sin, take_embeddings
from engine.models.moe import load_dense_mlp
from engine.ops import Ops


class Olmo2ForCausalLM:
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
        self.cfg = cfg
        self.ops = ops
        self.attention = attention
        self.linear: Linear = invariant_linear if deterministic else F.linear
        self.scale = cfg.head_dim**-0.5
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.cos_sin = layer_cos_sin(cfg, cfg.head_dim, max_positions, device)
        self.windows = cfg.layer_windows or (None,) * cfg.num_layers
        self.embed, self.norm, self.lm_head = take_embeddings(weights, cfg)
        self.layers = [self._layer(weights, i) for i in range(cfg.num_layers)]
        self.kv_scales = layer_scales(kv_scales, cfg.num_layers)  # the fp8 cache's (k, v) scales
        # The step's LoRA adapters (engine/lora.py), set by the model runner before each forward.
        self.lora: LoRABatch | None = None

    def lora_layout(self) -> list[dict[str, ModuleSlot]]:
        return dense_lora_layout(self.layers, self.q_size, self.kv_size, self.cfg.hidden_size)

    @staticmethod
    def _layer(w: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
        p = f"model.layers.{i}."
        a = p + "self_attn."
        return {
            "qkv": torch.cat(
                [w.pop(a + "q_proj.weight"), w.pop(a + "k_proj.weight"), w.pop(a + "v_proj.weight")]
            ),
            "q_norm": w.pop(a + "q_norm.weight"),  # over all heads' dims (EXAONE 4: one head's)
            "k_norm": w.pop(a + "k_norm.weight"),
            "o": w.pop(a + "o_proj.weight"),
            "post_attn_norm": w.pop(p + "post_attention_layernorm.weight"),
            "post_ff_norm": w.pop(p + "post_feedforward_layernorm.weight"),
            **load_dense_mlp(w, p + "mlp."),
        }

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The ids' input embeddings ``[T, hidden]``, as transformers' ``get_input_embeddings()``
        gives them (what prompt embeddings and image features stand in for; a fresh tensor)."""
        return F.embedding(input_ids, self.embed)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden]: instead of ``embed_tokens(input_ids)``
    ) -> torch.Tensor:
        """Hidden states after the final norm, ``[T, hidden]``."""
        cfg, ops, linear = self.cfg, self.ops, self.linear
        eps, d = cfg.rms_norm_eps, cfg.head_dim
        t = input_ids.shape[0]
        hidden = F.embedding(input_ids, self.embed) if inputs_embeds is None else inputs_embeds
        lora = self.lora
        layers = zip(self.layers, self.windows, self.cos_sin, kv_caches, self.kv_scales, strict=True)
        for i, (layer, window, cos_sin, (k_cache, v_cache), (k_scale, v_scale)) in enumerate(layers):
            qkv = linear(hidden, layer["qkv"], None)
            if lora is not None:
                lora.add(i, "qkv", hidden, qkv)
            # Rows of the norm's width: a token's whole projection, or (EXAONE 4) one head.
            q_rows = qkv[:, : self.q_size].reshape(-1, layer["q_norm"].shape[0])
            k_rows = qkv[:, self.q_size : self.q_size + self.kv_size].reshape(-1, layer["k_norm"].shape[0])
            q = ops.rms_norm(q_rows.contiguous(), layer["q_norm"], eps)[0]
            k = ops.rms_norm(k_rows.contiguous(), layer["k_norm"], eps)[0]
            q, k = q.view(t, cfg.num_heads, d), k.view(t, cfg.num_kv_heads, d)
            v = qkv[:, self.q_size + self.kv_size :].reshape(t, cfg.num_kv_heads, d).contiguous()
            if cos_sin is not None:  # None: a layer without rotary
                ops.rotary_embedding(positions, q, k, cos_sin)
            attn = self.attention.forward(
                q, k, v, k_cache, v_cache, meta, self.scale, window, k_scale=k_scale, v_scale=v_scale
            )
            attn = attn.reshape(t, self.q_size)
            out = linear(attn, layer["o"], None)
            if lora is not None:
                lora.add(i, "o", attn, out)
            hidden = hidden + ops.rms_norm(out, layer["post_attn_norm"], eps)[0]
            gate_up = linear(hidden, layer["gate_up"], None)
            if lora is not None:
                lora.add(i, "gate_up", hidden, gate_up)
            act = ops.silu_and_mul(gate_up)
            out = linear(act, layer["down"], None)
            if lora is not None:
                lora.add(i, "down", act, out)
            hidden = hidden + ops.rms_norm(out, layer["post_ff_norm"], eps)[0]
        return ops.rms_norm(hidden, self.norm, eps)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[N, vocab]`` for the rows that need them."""
        return self.linear(hidden, self.lm_head, None).float()
