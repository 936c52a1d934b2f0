"""Llama-family decoder over the paged KV cache: Llama 2/3, Mistral, Qwen2 (q/k/v bias), Qwen3
(per-head RMSNorm of q and k before rotary), Qwen3-MoE and Mixtral (mixture-of-experts MLPs), Phi-3
(fused qkv and gate_up weights, partial rotary), GLM-4.5 (q/k/v bias, partial rotary, optional q/k
norm, DeepSeek-V3's router and shared experts), Granite and Granite-MoE (embedding, attention, residual
and logit multipliers), Seed-OSS (q/k/v bias), SmolLM3 (layers without rotary), GLM-4-0414 (norms
after attention and MLP too, rotary in interleaved pairs), ERNIE 4.5 and its MoE (interleaved rotary;
a softmax router with a correction bias), Hunyuan dense (q/k norm after rotary), MiniMax-M2 (q/k norm
over all heads, partial rotary, a sigmoid router with a correction bias).

The forward works on a flattened batch: every new token of every scheduled sequence in one
``[T]`` dimension, so prefill chunks and decode steps share one pass. Weights are held as plain
tensors with q/k/v and gate/up fused into one matmul each; which op set and linear (fast or
batch-invariant) run is decided once at construction.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.lora import LoRABatch, ModuleSlot
from engine.models.config import ModelConfig
from engine.models.kv_scales import KVScales, layer_scales
from engine.models.moe import MoE, load_dense_mlp
from engine.models.rope import build_cos_sin_cache
from engine.ops import Ops

Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` whose row results do not depend on how many rows share the call.

    Inputs on a device in ``KERNEL_DEVICES`` (CUDA: cuBLAS picks kernels and split-K by M) go to the
    Triton matmul of ``engine/kernels/triton_matmul.py``. CPU inputs stay on MKL, whose summation
    order for a row depends on M twice over, measured: tiny M (< 12) takes another kernel, and with
    more than one thread a long input (M past ~128-256 at K >= 1024) is split across the threads
    another way. So every call has exactly ``MIN_INVARIANT_ROWS`` rows: short inputs are padded,
    long ones cut into tiles of that many rows (the last padded). Within one call shape a row's
    result does not depend on its place in the tile or on the other rows.
    """
    if x.device.type in KERNEL_DEVICES:
        return _kernel_linear(x.device.type)(x, weight, bias)
    m, tile = x.shape[0], MIN_INVARIANT_ROWS
    if m % tile:
        padded = x.new_zeros((m + tile - m % tile, x.shape[1]))
        padded[:m] = x
        x = padded
    outs = [F.linear(rows, weight, bias) for rows in x.split(tile)]
    return (outs[0] if len(outs) == 1 else torch.cat(outs))[:m]


MIN_INVARIANT_ROWS = 16
# Devices whose deterministic linears run the Triton matmul. The tests add "cpu" (under Triton's
# interpreter) to run the kernel path through the engine; the MKL path stays CPU's serving path.
KERNEL_DEVICES = frozenset({"cuda"})


@cache
def _kernel_linear(device: str) -> Linear:
    """The Triton matmul where Triton can run on ``device``; else ``F.linear``, with one warning that
    rows then depend on their batch (Triton is an optional dependency)."""
    from engine.kernels import triton_usable

    if triton_usable(device):
        from engine.kernels.triton_matmul import linear

        return linear
    warnings.warn(
        f"deterministic mode on {device} without triton: linear layers use F.linear, whose results "
        "depend on the batch (pip install 'ferry-serve[triton]' for batch invariance)",
        stacklevel=2,
    )
    return F.linear


def invariant_per_head(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x[t, h] @ w[h]`` for ``x`` [T, H, a] and ``w`` [H, a, b] -> [T, H, b] (DeepSeek's absorbed
    latent attention), each token's result independent of T: on ``KERNEL_DEVICES`` the Triton
    kernel (cuBLAS's batched matmul picks kernels by size too); on MKL, T padded to
    ``MIN_INVARIANT_ROWS`` as ``invariant_linear`` pads."""
    if x.device.type in KERNEL_DEVICES and _kernel_linear(x.device.type) is not F.linear:
        from engine.kernels.triton_matmul import per_head_matmul

        return per_head_matmul(x, w)
    t = x.shape[0]
    xt = x.transpose(0, 1)
    if t < MIN_INVARIANT_ROWS:
        padded = x.new_zeros((x.shape[1], MIN_INVARIANT_ROWS, x.shape[2]))
        padded[:, :t] = xt
        return torch.bmm(padded, w)[:, :t].transpose(0, 1)
    return torch.bmm(xt, w).transpose(0, 1)


def take_embeddings(
    w: dict[str, torch.Tensor], cfg: ModelConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token embeddings, final norm weight, lm_head) popped from ``w``; the lm_head is the
    embedding matrix when the model ties them or the checkpoint has none (a base model)."""
    embed, norm = w.pop("model.embed_tokens.weight"), w.pop("model.norm.weight")
    head = w.pop("lm_head.weight", None)
    return embed, norm, embed if cfg.tie_word_embeddings or head is None else head


def dense_lora_layout(
    layers: list[dict[str, Any]], q: int, kv: int, hidden: int
) -> list[dict[str, ModuleSlot]]:
    """Per layer, the projections a LoRA adapter may target, for a model whose layers hold fused
    ``qkv`` / ``o`` / ``gate_up`` / ``down`` weights: PEFT's module name -> (fused group, first output
    row in it, in features, out features). A layer without ``gate_up`` (experts) takes none there."""
    layouts = []
    for layer in layers:
        slots: dict[str, ModuleSlot] = {
            "q_proj": ("qkv", 0, hidden, q),
            "k_proj": ("qkv", q, hidden, kv),
            "v_proj": ("qkv", q + kv, hidden, kv),
            "qkv_proj": ("qkv", 0, hidden, q + 2 * kv),
            "o_proj": ("o", 0, q, hidden),
        }
        if "gate_up" in layer:
            inter = layer["down"].shape[1]
            slots["gate_proj"] = ("gate_up", 0, hidden, inter)
            slots["up_proj"] = ("gate_up", inter, hidden, inter)
            slots["gate_up_proj"] = ("gate_up", 0, hidden, 2 * inter)
            slots["down_proj"] = ("down", 0, inter, hidden)
        layouts.append(slots)
    return layouts


def layer_cos_sin(
    cfg: ModelConfig, rotary_dim: int, max_positions: int, device: torch.device
) -> list[torch.Tensor | None]:
    """Per layer, its rotary cos/sin table (one table per distinct rope), None for a NoPE layer."""
    ropes = cfg.layer_rope or ((cfg.rope_theta, cfg.rope_scaling),) * cfg.num_layers
    tables: dict[str, torch.Tensor] = {}
    out: list[torch.Tensor | None] = []
    for rope in ropes:
        if rope is not None and repr(rope) not in tables:
            tables[repr(rope)] = build_cos_sin_cache(rotary_dim, max_positions, *rope, device)
        out.append(None if rope is None else tables[repr(rope)])
    return out


def apply_rope(
    ops: Ops,
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin: torch.Tensor,
    rotary_dim: int,
    interleave: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` [T, Hq, D] and ``k`` [T, Hkv, D] with their first ``rotary_dim`` dims rotated. With
    ``interleave`` (GLM-4, ERNIE 4.5) the pairs are (x0, x1), (x2, x3)…: those dims are gathered into
    halves and rotated half-split, as transformers does. q and k move alike, so every q.k (all that
    attention reads of them; the cache holds k so permuted) is unchanged."""
    d = q.shape[-1]
    if rotary_dim == d and not interleave:
        q, k = q.contiguous(), k.contiguous()
        ops.rotary_embedding(positions, q, k, cos_sin)
        return q, k
    q_rot, k_rot = q[..., :rotary_dim], k[..., :rotary_dim]
    if interleave:
        q_rot = torch.cat([q_rot[..., 0::2], q_rot[..., 1::2]], dim=-1)
        k_rot = torch.cat([k_rot[..., 0::2], k_rot[..., 1::2]], dim=-1)
    q_rot, k_rot = q_rot.contiguous(), k_rot.contiguous()
    ops.rotary_embedding(positions, q_rot, k_rot, cos_sin)
    if rotary_dim == d:
        return q_rot, k_rot
    return torch.cat([q_rot, q[..., rotary_dim:]], dim=-1), torch.cat([k_rot, k[..., rotary_dim:]], dim=-1)


def split_heads(qkv: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused q/k/v projection ``[T, (Hq + 2 Hkv) D]`` as q ``[T, Hq, D]``, k and v ``[T, Hkv, D]``."""
    t, q_size, kv_size = qkv.shape[0], cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    q = qkv[:, :q_size].reshape(t, cfg.num_heads, cfg.head_dim)
    k = qkv[:, q_size : q_size + kv_size].reshape(t, cfg.num_kv_heads, cfg.head_dim)
    v = qkv[:, q_size + kv_size :].reshape(t, cfg.num_kv_heads, cfg.head_dim)
    return q, k, v


def head_norm(ops: Ops, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` [T, H, D] in rows of the weight's width: one head (Qwen3, Hunyuan) or all of
    a token's heads at once (MiniMax-M2)."""
    return ops.rms_norm(x.reshape(-1, weight.shape[0]), weight, eps)[0].view(x.shape)


class LlamaForCausalLM:
    # MoE routers that checkpoints store in fp32 (GLM-4.5, ERNIE 4.5) stay fp32, as transformers keeps them.
    FP32_WEIGHTS = (
        "mlp.gate.weight",
        "mlp.gate.e_score_correction_bias",
        "mlp.moe_statics.e_score_correction_bias",  # ERNIE 4.5's name
        "block_sparse_moe.e_score_correction_bias",  # MiniMax-M2's
    )

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
        self.moe = (
            None
            if cfg.moe is None
            else MoE(cfg.moe, self.linear, ops.silu_and_mul, ops.fused_moe, deterministic=deterministic)
        )
        self.scale = cfg.attention_multiplier or cfg.head_dim**-0.5
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        # Partial rotary (Phi-4-mini): only the first rotary_dim dims of each head rotate.
        self.rotary_dim = int(cfg.head_dim * cfg.partial_rotary_factor)
        self.cos_sin = layer_cos_sin(cfg, self.rotary_dim, max_positions, device)
        self.embed, self.norm, self.lm_head = take_embeddings(weights, cfg)
        self.layers = [self._layer(weights, i) for i in range(cfg.num_layers)]
        self.windows = cfg.layer_windows or (None,) * cfg.num_layers
        self.kv_scales = layer_scales(kv_scales, cfg.num_layers)  # the fp8 cache's (k, v) scales
        # The step's LoRA adapters (engine/lora.py), set by the model runner before each forward.
        self.lora: LoRABatch | None = None

    def lora_layout(self) -> list[dict[str, ModuleSlot]]:
        """Per layer, the projections a LoRA adapter may target (``dense_lora_layout``)."""
        return dense_lora_layout(self.layers, self.q_size, self.kv_size, self.cfg.hidden_size)

    def _layer(self, w: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor | None]:
        p = f"model.layers.{i}."
        a = p + "self_attn."
        bias = None
        if a + "qkv_proj.weight" in w:  # Phi-3 stores q/k/v fused
            qkv, bias = w[a + "qkv_proj.weight"], w.get(a + "qkv_proj.bias")
        else:
            qkv = torch.cat([w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]])
        if a + "q_proj.bias" in w:
            bias = torch.cat([w[a + "q_proj.bias"], w[a + "k_proj.bias"], w[a + "v_proj.bias"]])
        # Mixtral's and MiniMax-M2's name for the MoE block (gate.weight), and Granite-MoE's.
        moe_block = (p + "block_sparse_moe.gate.weight", p + "block_sparse_moe.router.layer.weight")
        m = p + ("block_sparse_moe." if any(name in w for name in moe_block) else "mlp.")
        layer = {
            "in_norm": w[p + "input_layernorm.weight"],
            "qkv": qkv,
            "qkv_bias": bias,
            "o": w[a + "o_proj.weight"],
            "o_bias": w.get(a + "o_proj.bias"),
            "post_norm": w[p + "post_attention_layernorm.weight"],
        }
        if p + "post_self_attn_layernorm.weight" in w:  # GLM-4: also norms after attention and MLP
            layer["attn_out_norm"] = w[p + "post_self_attn_layernorm.weight"]
            layer["mlp_out_norm"] = w[p + "post_mlp_layernorm.weight"]
        if a + "q_norm.weight" in w:  # Qwen3
            layer["q_norm"], layer["k_norm"] = w[a + "q_norm.weight"], w[a + "k_norm.weight"]
        if a + "query_layernorm.weight" in w:  # Hunyuan: the same per-head norms, after rotary
            layer["q_norm_roped"] = w[a + "query_layernorm.weight"]
            layer["k_norm_roped"] = w[a + "key_layernorm.weight"]
        moe = self.moe is not None and self.moe.cfg.is_moe_layer(i)
        layer.update(self.moe.load(w, m) if moe else self._load_mlp(w, m))  # type: ignore[union-attr]
        return layer

    # A dense layer's MLP weights at ``….mlp.`` (SwiGLU's; Arcee's subclass loads its ungated MLP).
    _load_mlp = staticmethod(load_dense_mlp)

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
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden]: instead of the ids' embeddings
    ) -> torch.Tensor:
        """Hidden states after the final norm, ``[T, hidden]``."""
        cfg, ops, linear = self.cfg, self.ops, self.linear
        eps = cfg.rms_norm_eps
        hidden = F.embedding(input_ids, self.embed) if inputs_embeds is None else inputs_embeds
        if cfg.embedding_multiplier != 1.0:
            hidden = hidden * cfg.embedding_multiplier
        scale_out = cfg.residual_multiplier != 1.0  # Granite scales each block's output
        residual: torch.Tensor | None = None
        t = input_ids.shape[0]
        lora = self.lora
        for i, (layer, window, cos_sin, (k_cache, v_cache), (k_scale, v_scale)) in enumerate(
            zip(self.layers, self.windows, self.cos_sin, kv_caches, self.kv_scales, strict=True)
        ):
            x, residual = ops.rms_norm(hidden, layer["in_norm"], eps, residual)
            if residual is None:
                residual = hidden
            qkv = linear(x, layer["qkv"], layer["qkv_bias"])
            if lora is not None:
                lora.add(i, "qkv", x, qkv)
            q, k, v = split_heads(qkv, cfg)
            if "q_norm" in layer:  # before rotary
                q, k = head_norm(ops, q, layer["q_norm"], eps), head_norm(ops, k, layer["k_norm"], eps)
            if cos_sin is not None:
                q, k = apply_rope(ops, positions, q, k, cos_sin, self.rotary_dim, cfg.rope_interleave)
            if "q_norm_roped" in layer:  # Hunyuan: after rotary
                q = head_norm(ops, q, layer["q_norm_roped"], eps)
                k = head_norm(ops, k, layer["k_norm_roped"], eps)
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
            )
            attn = attn.reshape(t, self.q_size)
            hidden = linear(attn, layer["o"], layer["o_bias"])
            if lora is not None:
                lora.add(i, "o", attn, hidden)
            if scale_out:
                hidden = hidden * cfg.residual_multiplier
            if "attn_out_norm" in layer:  # GLM-4's sandwich: the block's output normed before the add
                hidden = ops.rms_norm(hidden, layer["attn_out_norm"], eps)[0]
            x, residual = ops.rms_norm(hidden, layer["post_norm"], eps, residual)
            hidden = self._mlp(i, layer, x)
            if scale_out:
                hidden = hidden * cfg.residual_multiplier
            if "mlp_out_norm" in layer:
                hidden = ops.rms_norm(hidden, layer["mlp_out_norm"], eps)[0]
        out, _ = ops.rms_norm(hidden, self.norm, eps, residual)
        return out

    def _mlp(self, i: int, layer: dict[str, torch.Tensor | None], x: torch.Tensor) -> torch.Tensor:
        """Layer ``i``'s MLP (experts or SwiGLU) of its normed input ``x``; subclasses with another MLP
        (Arcee's ReLU^2) override it."""
        linear, lora = self.linear, self.lora
        if "router" in layer:
            return self.moe.forward(x, layer)  # type: ignore[union-attr]
        if lora is None:
            return linear(self.ops.silu_and_mul(linear(x, layer["gate_up"], None)), layer["down"], None)
        gate_up = lora.add(i, "gate_up", x, linear(x, layer["gate_up"], None))
        act = self.ops.silu_and_mul(gate_up)
        return lora.add(i, "down", act, linear(act, layer["down"], None))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[N, vocab]`` for the rows that need them (never the whole batch)."""
        logits = self.linear(hidden, self.lm_head, None).float()
        return logits / self.cfg.logits_scaling if self.cfg.logits_scaling != 1.0 else logits
