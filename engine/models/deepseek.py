"""DeepSeek-V2/V3 decoder (also R1, Kimi K2): multi-head latent attention (MLA) and a mixture of experts.

MLA caches one latent vector per token and layer: ``kv_lora_rank`` dims of compressed keys and
values (after ``kv_a_layernorm``) plus ``qk_rope_head_dim`` dims of rotated key shared by all
heads: 576 values for DeepSeek-V3 instead of 128 heads x (192 + 128). Attention runs in the
absorbed form: ``kv_b_proj``'s key half is folded into each head's query (``q_nope @ W_UK``), so
every head attends over the cached latents directly as one shared KV head whose values are the
latent's first ``kv_lora_rank`` dims; the value half (``W_UV``) is applied to each head's output.
The cache is never expanded per head, for prefill and decode alike.

MoE layers route each token to ``experts_per_token`` of ``num_experts`` experts (V3: sigmoid
scores plus a correction bias choose, group-limited, the raw scores weigh, normalised and scaled;
V2: softmax scores, top-k overall or within the best groups) and always add the shared experts. Experts run one matmul pair per expert over the tokens routed to
it. The first ``first_dense_layers`` layers have a dense MLP instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.models.config import ModelConfig
from engine.models.llama import Linear, invariant_linear
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
    ) -> None:
        if cfg.mla is None or cfg.moe is None:
            raise ValueError(f"{cfg.architecture} needs kv_lora_rank and n_routed_experts in config.json")
        self.cfg, self.mla, self.moe = cfg, cfg.mla, cfg.moe
        self.ops = ops
        self.attention = attention
        self.deterministic = deterministic
        self.linear: Linear = invariant_linear if deterministic else F.linear
        mla = self.mla
        self.qk_head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        self.scale = self.qk_head_dim**-0.5 * softmax_scale_factor(cfg.rope_scaling)
        self.cos_sin_cache = build_cos_sin_cache(
            mla.qk_rope_head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, device
        )
        self.embed = weights.pop("model.embed_tokens.weight")
        self.norm = weights.pop("model.norm.weight")
        head = weights.pop("lm_head.weight", None)
        self.lm_head = self.embed if cfg.tie_word_embeddings or head is None else head
        self.layers = [self._layer(weights, i) for i in range(cfg.num_layers)]

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
        if self.moe.is_moe_layer(i):
            e = self.moe.num_experts
            if m + "experts.gate_up_proj" in w:  # transformers' fused in-memory layout
                w13, w2 = w.pop(m + "experts.gate_up_proj"), w.pop(m + "experts.down_proj")
            else:  # checkpoints: one tensor per expert
                w13 = torch.stack(
                    [torch.cat([w.pop(f"{m}experts.{j}.gate_proj.weight"), w.pop(f"{m}experts.{j}.up_proj.weight")]) for j in range(e)]
                )  # fmt: skip
                w2 = torch.stack([w.pop(f"{m}experts.{j}.down_proj.weight") for j in range(e)])
            layer["w13"], layer["w2"] = w13, w2  # [E, 2I, hidden], [E, hidden, I]
            layer["router"] = w.pop(m + "gate.weight").float()
            bias = w.pop(m + "gate.e_score_correction_bias", None)
            layer["router_bias"] = (
                torch.zeros(e, dtype=torch.float32, device=w13.device) if bias is None else bias.float()
            )
            s = m + "shared_experts."
            if self.moe.num_shared_experts:
                layer["gate_up"] = torch.cat([w.pop(s + "gate_proj.weight"), w.pop(s + "up_proj.weight")])
                layer["down"] = w.pop(s + "down_proj.weight")
        else:
            layer["gate_up"] = torch.cat([w.pop(m + "gate_proj.weight"), w.pop(m + "up_proj.weight")])
            layer["down"] = w.pop(m + "down_proj.weight")
        return layer

    # -- forward -------------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor]],  # per layer, the latent cache [blocks, bs, 1, rank + rope]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states after the final norm, ``[T, hidden]``."""
        ops, eps = self.ops, self.cfg.rms_norm_eps
        hidden = F.embedding(input_ids, self.embed)
        residual: torch.Tensor | None = None
        for layer, (kv_cache,) in zip(self.layers, kv_caches, strict=True):
            x, residual = ops.rms_norm(hidden, layer["in_norm"], eps, residual)
            if residual is None:
                residual = hidden
            hidden = self._attention(x, positions, layer, kv_cache, meta)
            x, residual = ops.rms_norm(hidden, layer["post_norm"], eps, residual)
            hidden = self._moe(x, layer) if "router" in layer else self._mlp(x, layer)
        out, _ = ops.rms_norm(hidden, self.norm, eps, residual)
        return out

    def _attention(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        layer: dict,
        kv_cache: torch.Tensor,
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
        o = self.attention.forward_mla(q_full, kv, kv_cache, meta, self.scale, mla.kv_lora_rank)
        o = self._per_head(o, layer["w_uv_t"])  # [T, H, v]
        return linear(o.reshape(t, heads * mla.v_head_dim), layer["o"], layer["o_bias"])

    def _per_head(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x[t, h] @ w[h]`` for ``x`` [T, H, a] and ``w`` [H, a, b] -> [T, H, b], one batched matmul.

        Deterministic mode pads T to the rows where the matmul's per-row result stops depending
        on T (as ``invariant_linear`` does)."""
        t = x.shape[0]
        xt = x.transpose(0, 1)
        if self.deterministic and t < _MIN_ROWS:
            padded = x.new_zeros((x.shape[1], _MIN_ROWS, x.shape[2]))
            padded[:, :t] = xt
            return torch.bmm(padded, w)[:, :t].transpose(0, 1)
        return torch.bmm(xt, w).transpose(0, 1)

    def _mlp(self, x: torch.Tensor, layer: dict) -> torch.Tensor:
        return self.linear(self.ops.silu_and_mul(self.linear(x, layer["gate_up"], None)), layer["down"], None)

    def _moe(self, x: torch.Tensor, layer: dict) -> torch.Tensor:
        moe, linear = self.moe, self.linear
        weights, experts = self._route(x, layer)  # [T, k] fp32, [T, k]
        out = torch.zeros_like(x)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, token order kept
        counts = torch.bincount(flat, minlength=moe.num_experts).tolist()
        tokens = order // moe.experts_per_token
        flat_weights = weights.reshape(-1)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows, pairs = tokens[start : start + n], order[start : start + n]
            start += n
            h = linear(
                self.ops.silu_and_mul(linear(x.index_select(0, rows), layer["w13"][e], None)),
                layer["w2"][e],
                None,
            )
            out.index_add_(0, rows, (h * flat_weights.index_select(0, pairs)[:, None]).to(x.dtype))
        if "gate_up" in layer:
            out = out + self._mlp(x, layer)
        return out

    def _route(self, x: torch.Tensor, layer: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts and their fp32 weights (see ``MoEConfig``)."""
        logits = self.linear(x.float(), layer["router"], None)
        if self.moe.scoring == "softmax":
            return self._route_v2(logits.softmax(dim=-1))
        return self._route_v3(logits.sigmoid(), layer["router_bias"])

    def _route_v2(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Softmax scores; with ``group_limited_greedy`` only the ``topk_groups`` groups holding
        the best single scores compete."""
        moe = self.moe
        if moe.topk_method == "group_limited_greedy":
            t = scores.shape[0]
            grouped = scores.view(t, moe.num_groups, -1)
            keep = torch.zeros(t, moe.num_groups, dtype=torch.bool, device=scores.device)
            keep.scatter_(1, grouped.amax(dim=-1).topk(moe.topk_groups, dim=-1, sorted=False)[1], True)
            scores = grouped.masked_fill(~keep[:, :, None], 0.0).view(t, -1)
        weights, experts = scores.topk(moe.experts_per_token, dim=-1, sorted=False)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * moe.routed_scaling_factor, experts

    def _route_v3(self, scores: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sigmoid scores; the choice adds the correction bias and keeps only the
        ``topk_groups`` groups whose two best experts score highest; the raw scores weigh."""
        moe = self.moe
        t = scores.shape[0]
        choice = scores + bias
        if moe.num_groups > 1:
            grouped = choice.view(t, moe.num_groups, -1)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, groups]
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(moe.topk_groups, dim=-1, sorted=False)[1], True)
            choice = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(t, -1)
        experts = choice.topk(moe.experts_per_token, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * moe.routed_scaling_factor, experts

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[N, vocab]`` for the rows that need them."""
        return self.linear(hidden, self.lm_head, None).float()


_MIN_ROWS = 16
