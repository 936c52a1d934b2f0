"""DeepSeek-V2/V3 decoder (also R1, Kimi K2): multi-head latent attention (MLA) and a mixture of experts.

MLA caches one latent vector per token and layer: ``kv_lora_rank`` dims of compressed keys and
values (after ``kv_a_layernorm``) plus ``qk_rope_head_dim`` dims of rotated key shared by all
heads: 576 values for DeepSeek-V3 instead of 128 heads x (192 + 128). Attention runs in the
absorbed form: ``kv_b_proj``'s key half is folded into each head's query (``q_nope @ W_UK``), so
every head attends over the cached latents directly as one shared KV head whose values are the
latent's first ``kv_lora_rank`` dims; the value half (``W_UV``) is applied to each head's output.
The cache is never expanded per head, for prefill and decode alike.

MoE layers (``engine/models/moe.py``) route each token to ``experts_per_token`` of ``num_experts``
experts (V3: sigmoid scores plus a correction bias choose, group-limited; V2: softmax scores, top-k
overall or within the best groups) and add the shared experts; the first ``first_dense_layers``
layers have a dense MLP instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.models.config import ModelConfig
from engine.models.decoder import Linear, invariant_linear, invariant_per_head, take_embeddings
from engine.models.kv_scales import KVScales, layer_scales
from engine.models.moe import MoE, load_dense_mlp
from engine.models.rope import build_cos_sin_cache, softmax_scale_factor
from engine.ops import Ops

Weights = dict[str, torch.Tensor]


class DeepseekForCausalLM:
    # transformers keeps the router in fp32 whatever the model dtype; so does the loader.
    FP32_WEIGHTS = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")

    def __init__(
        self,
        cfg: ModelConfig,
        weights: Weights,
        *,
        ops: Ops,
        attention: AttentionBackend,
        deterministic: bool,
        max_positions: int,
        device: torch.device,
        kv_scales: KVScales | None = None,
    ) -> None:
        if cfg.mla is None or cfg.moe is None:
            raise ValueError(f"{cfg.architecture} needs kv_lora_rank and n_routed_experts in config.json")
        self.cfg, self.mla, self.moe = cfg, cfg.mla, cfg.moe
        self.ops = ops
        self.attention = attention
        self.deterministic = deterministic
        self.linear: Linear = invariant_linear if deterministic else F.linear
        self.moe_mlp = MoE(
            self.moe, self.linear, ops.silu_and_mul, ops.fused_moe, deterministic=deterministic
        )
        mla = self.mla
        self.qk_head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        self.scale = self.qk_head_dim**-0.5 * softmax_scale_factor(cfg.rope_scaling)
        self.cos_sin_cache = build_cos_sin_cache(
            mla.qk_rope_head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, device
        )
        self._load(weights, kv_scales)

    def _load(self, weights: Weights, kv_scales: KVScales | None) -> None:
        """Take the layers this model runs from ``weights`` (the MTP layer takes its own instead,
        engine/models/deepseek_mtp.py)."""
        cfg = self.cfg
        self.embed, self.norm, self.lm_head = take_embeddings(weights, cfg)
        self.layers = [self._layer(weights, i) for i in range(cfg.num_layers)]
        # The fp8 latent cache's scale per layer: the layer's k_scale (values are the latent too).
        self.kv_scales = [k for k, _ in layer_scales(kv_scales, cfg.num_layers)]

    # -- weights -------------------------------------------------------------------------------------

    def _layer(self, w: Weights, i: int) -> dict[str, torch.Tensor | None]:
        cfg, mla = self.cfg, self.mla
        p = f"model.layers.{i}."
        a = p + "self_attn."
        heads = cfg.num_heads
        layer: dict[str, torch.Tensor | None] = {
            "in_norm": w.pop(p + "input_layernorm.weight"),
            "post_norm": w.pop(p + "post_attention_layernorm.weight"),
            "kv_a_norm": w.pop(a + "kv_a_layernorm.weight"),
            "o": w.pop(a + "o_proj.weight"),
            "o_bias": w.pop(a + "o_proj.bias", None),
        }
        kv_a, kv_a_bias = w.pop(a + "kv_a_proj_with_mqa.weight"), w.pop(a + "kv_a_proj_with_mqa.bias", None)
        if mla.q_lora_rank is not None:
            # q_a_proj and kv_a_proj_with_mqa read the same input: one matmul for both.
            q_a, q_a_bias = w.pop(a + "q_a_proj.weight"), w.pop(a + "q_a_proj.bias", None)
            layer["a"] = torch.cat([q_a, kv_a])
            layer["a_bias"] = None if kv_a_bias is None else torch.cat([q_a_bias, kv_a_bias])
            layer["q_a_norm"] = w.pop(a + "q_a_layernorm.weight")
            layer["q_b"] = w.pop(a + "q_b_proj.weight")
        else:
            layer["a"], layer["a_bias"] = kv_a, kv_a_bias
            layer["q"] = w.pop(a + "q_proj.weight")
        # kv_b_proj: [H * (nope + v), rank] -> per head, the key half folded into queries and the
        # value half applied to outputs.
        kv_b = w.pop(a + "kv_b_proj.weight").view(
            heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank
        )
        layer["w_uk"] = kv_b[:, : mla.qk_nope_head_dim].contiguous()  # [H, nope, rank]
        layer["w_uv_t"] = kv_b[:, mla.qk_nope_head_dim :].transpose(1, 2).contiguous()  # [H, rank, v]
        m = p + "mlp."
        layer.update(self.moe_mlp.load(w, m) if self.moe.is_moe_layer(i) else load_dense_mlp(w, m))
        return layer

    # -- forward -------------------------------------------------------------------------------------

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The ids' input embeddings ``[T, hidden]``, as transformers' ``get_input_embeddings()``
        gives them (what prompt embeddings and image features stand in for; a fresh tensor)."""
        return F.embedding(input_ids, self.embed)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor]],  # per layer, the latent cache [blocks, bs, 1, rank + rope]
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden]: instead of ``embed_tokens(input_ids)``
    ) -> torch.Tensor:
        """Hidden states after the final norm, ``[T, hidden]``."""
        ops, eps = self.ops, self.cfg.rms_norm_eps
        hidden = F.embedding(input_ids, self.embed) if inputs_embeds is None else inputs_embeds
        residual: torch.Tensor | None = None
        for layer, (kv_cache,), kv_scale in zip(self.layers, kv_caches, self.kv_scales, strict=True):
            hidden, residual = self._decoder_layer(
                hidden, residual, positions, layer, kv_cache, kv_scale, meta
            )
        out, _ = ops.rms_norm(hidden, self.norm, eps, residual)
        return out

    def _decoder_layer(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        layer: dict,
        kv_cache: torch.Tensor,
        kv_scale: float,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer: (its output, the residual stream before it; their sum is the layer's result)."""
        ops, eps = self.ops, self.cfg.rms_norm_eps
        x, residual = ops.rms_norm(hidden, layer["in_norm"], eps, residual)
        if residual is None:
            residual = hidden
        hidden = self._attention(x, positions, layer, kv_cache, kv_scale, meta)
        x, residual = ops.rms_norm(hidden, layer["post_norm"], eps, residual)
        hidden = self.moe_mlp.forward(x, layer) if "router" in layer else self._mlp(x, layer)
        return hidden, residual

    def _attention(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        layer: dict,
        kv_cache: torch.Tensor,
        kv_scale: float,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        mla, ops, linear, eps = self.mla, self.ops, self.linear, self.cfg.rms_norm_eps
        t, heads = x.shape[0], self.cfg.num_heads
        a = linear(x, layer["a"], layer["a_bias"])
        if mla.q_lora_rank is not None:
            q_a, kv_a = a[:, : mla.q_lora_rank], a[:, mla.q_lora_rank :]
            q = linear(ops.rms_norm(q_a.contiguous(), layer["q_a_norm"], eps)[0], layer["q_b"], None)
        else:
            kv_a = a
            q = linear(x, layer["q"], None)
        q = q.view(t, heads, self.qk_head_dim)
        q_nope, q_pe = q[..., : mla.qk_nope_head_dim], q[..., mla.qk_nope_head_dim :]
        latent = ops.rms_norm(kv_a[:, : mla.kv_lora_rank].contiguous(), layer["kv_a_norm"], eps)[0]
        k_pe = kv_a[:, mla.kv_lora_rank :].reshape(t, 1, mla.qk_rope_head_dim)
        if mla.rope_interleave:
            # Pairs (x0, x1), (x2, x3)…: gathered into halves, the usual rotate-half rope applies
            # (transformers does the same; q and k move alike, so their dot product is unchanged).
            q_pe = torch.cat([q_pe[..., 0::2], q_pe[..., 1::2]], dim=-1)
            k_pe = torch.cat([k_pe[..., 0::2], k_pe[..., 1::2]], dim=-1)
        else:
            q_pe, k_pe = q_pe.contiguous(), k_pe.contiguous()
        ops.rotary_embedding(positions, q_pe, k_pe, self.cos_sin_cache)
        q_latent = self._per_head(q_nope, layer["w_uk"])  # [T, H, rank]
        q_full = torch.cat([q_latent, q_pe], dim=-1)
        kv = torch.cat([latent[:, None, :], k_pe], dim=-1)  # [T, 1, rank + rope]
        o = self.attention.forward_mla(q_full, kv, kv_cache, meta, self.scale, mla.kv_lora_rank, kv_scale)
        o = self._per_head(o, layer["w_uv_t"])  # [T, H, v]
        return linear(o.reshape(t, heads * mla.v_head_dim), layer["o"], layer["o_bias"])

    def _per_head(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x[t, h] @ w[h]`` for ``x`` [T, H, a] and ``w`` [H, a, b] -> [T, H, b], one batched matmul
        (deterministic mode: ``invariant_per_head``, whose per-token result does not depend on T)."""
        if self.deterministic:
            return invariant_per_head(x, w)
        return torch.bmm(x.transpose(0, 1), w).transpose(0, 1)

    def _mlp(self, x: torch.Tensor, layer: dict) -> torch.Tensor:
        return self.linear(self.ops.silu_and_mul(self.linear(x, layer["gate_up"], None)), layer["down"], None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[N, vocab]`` for the rows that need them."""
        return self.linear(hidden, self.lm_head, None).float()
