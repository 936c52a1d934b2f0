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

from engine.attention.base import AttentionMetadata
from engine.models.decoder import DecoderBase, KVCache, Layer
from engine.models.moe import load_dense_mlp


class Olmo2ForCausalLM(DecoderBase):
    @staticmethod
    def _layer(w: dict[str, torch.Tensor], i: int) -> Layer:
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
        eps, d = cfg.rms_norm_eps, cfg.head_dim
        t = input_ids.shape[0]
        hidden = F.embedding(input_ids, self.embed) if inputs_embeds is None else inputs_embeds
        for i, layer, window, cos_sin, kv_cache, scales in self._per_layer(kv_caches):
            qkv = self._project(i, "qkv", hidden, layer["qkv"])
            # Rows of the norm's width: a token's whole projection, or (EXAONE 4) one head.
            q_rows = qkv[:, : self.q_size].reshape(-1, layer["q_norm"].shape[0])
            k_rows = qkv[:, self.q_size : self.q_size + self.kv_size].reshape(-1, layer["k_norm"].shape[0])
            q = ops.rms_norm(q_rows.contiguous(), layer["q_norm"], eps)[0]
            k = ops.rms_norm(k_rows.contiguous(), layer["k_norm"], eps)[0]
            q, k = q.view(t, cfg.num_heads, d), k.view(t, cfg.num_kv_heads, d)
            v = qkv[:, self.q_size + self.kv_size :].reshape(t, cfg.num_kv_heads, d)
            if cos_sin is not None:  # None: a layer without rotary
                ops.rotary_embedding(positions, q, k, cos_sin)
            out = self._attend(i, layer, q, k, v, kv_cache, scales, meta, window)
            hidden = hidden + ops.rms_norm(out, layer["post_attn_norm"], eps)[0]
            hidden = hidden + ops.rms_norm(self._swiglu(i, layer, hidden), layer["post_ff_norm"], eps)[0]
        return ops.rms_norm(hidden, self.norm, eps)[0]
