"""Bloom and MPT decoders (``BloomForCausalLM``, ``MptForCausalLM``) over the paged KV cache.

Neither embeds or rotates positions: each head's attention scores get an ALiBi bias, a slope times
the distance between key and query (engine/attention/alibi.py, passed to the attention backend as
``alibi``). The bias depends on absolute positions only, so prefill chunks, prefix-cache hits and
blocks from the KV tier attend exactly as one whole prefill. Both are pre-norm LayerNorm decoders
with full multi-head attention from one fused q/k/v projection and an ungated MLP, as transformers
computes them:

* Bloom: a LayerNorm on the embeddings (``word_embeddings_layernorm``, on prompt embeddings too);
  LayerNorms and every projection with biases; ``query_key_value`` stores each head's q, k, v rows
  together (regrouped at load into all q rows, all k, all v); the tanh GELU as Bloom writes it
  (``bloom_gelu``); ``apply_residual_connection_post_layernorm`` adds each block's output to its
  normed input instead of its input; Bloom's slopes. ``pretraining_tp`` / ``slow_but_exact`` only
  change transformers' summation order, not the model. The head is tied to the embeddings.
* MPT (MPT-7B, MPT-30B): LayerNorms without bias, no projection biases, ``Wqkv`` rows q, k, v in
  order, clamped to ``attn_config.clip_qkv`` when set, attention scaled by ``softmax_scale`` when set,
  exact GELU, an MLP ``expansion_ratio`` times the hidden size, MPT's slopes with
  ``alibi_bias_max``. Deliberate difference: transformers ignores ``alibi_bias_max`` (its slopes are
  always those of 8, the value every MosaicML checkpoint has) and ``expansion_ratio`` (always 4);
  ferry computes both as MosaicML's code does. Options neither computes as MosaicML's code does
  (``qk_ln``, ``no_bias`` false, ``logit_scale``, ``prefix_lm``, learned positions) are refused at
  load (engine/models/config_alibi.py; a checkpoint with ``wpe`` weights here).

LoRA: neither takes adapters. Their modules sit under ``transformer.h.N.self_attention`` /
``transformer.blocks.N.attn``, names engine/lora.py does not read (an adapter is refused when a
request names it, never applied wrongly), and Bloom's ``query_key_value`` rows are regrouped at load,
which an adapter's rows would have to follow.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from engine.attention.alibi import bloom_alibi_slopes, mpt_alibi_slopes
from engine.attention.base import AttentionMetadata
from engine.lora import ModuleSlot
from engine.models.config import AlibiConfig, ModelConfig
from engine.models.decoder import DecoderBase, KVCache, Layer, split_heads


def bloom_gelu(x: torch.Tensor) -> torch.Tensor:
    """Bloom's tanh GELU in its own constants and order of operations (transformers' ``BloomGelu``)."""
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


class BloomForCausalLM(DecoderBase):
    WEIGHT_RENAMES = {
        "BloomForCausalLM": (
            ("transformer.h.", "model.layers."),
            ("transformer.word_embeddings_layernorm.", "model.embed_norm."),
            ("transformer.word_embeddings.", "model.embed_tokens."),
            ("transformer.ln_f.", "model.norm."),
            ("h.", "model.layers."),  # the hub's Bloom files: no ``transformer.`` prefix
            ("word_embeddings_layernorm.", "model.embed_norm."),
            ("word_embeddings.", "model.embed_tokens."),
            ("ln_f.", "model.norm."),
            ("lm_head.", "lm_head."),
        )
    }

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], **options: Any) -> None:
        if cfg.alibi is None:
            raise ValueError(f"{cfg.architecture} needs ALiBi settings (a Bloom or MPT config)")
        self.alibi: AlibiConfig = cfg.alibi
        super().__init__(cfg, weights, **options)

    def lora_layout(self) -> list[dict[str, ModuleSlot]]:
        """No projection takes an adapter (see the module's docstring)."""
        return [{} for _ in self.layers]

    def _attention_scale(self) -> float:
        return 1.0 / math.sqrt(self.cfg.head_dim)  # transformers' inv_norm_factor, the same float

    def _rotary_tables(self, max_positions: int, device: torch.device) -> list[torch.Tensor | None]:
        return [None] * self.cfg.num_layers  # positions are ALiBi biases, not rotations

    def _slopes(self) -> torch.Tensor:
        return bloom_alibi_slopes(self.cfg.num_heads)

    def _setup(self, w: dict[str, torch.Tensor]) -> None:
        self.slopes = self._slopes().to(self.embed.device)
        self.embed_norm = w.pop("model.embed_norm.weight", None)
        self.embed_norm_bias = w.pop("model.embed_norm.bias", None)
        self.norm_bias = w.pop("model.norm.bias", None)
        self.act = bloom_gelu

    def _layer(self, w: dict[str, torch.Tensor], i: int) -> Layer:
        p = f"model.layers.{i}."
        heads = self.cfg.num_heads

        def regroup(t: torch.Tensor) -> torch.Tensor:
            """Rows [head][q|k|v][dim] -> [q|k|v][head][dim]."""
            return t.view(heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)

        a = p + "self_attention."
        return {
            "in_norm": w.pop(p + "input_layernorm.weight"),
            "in_norm_bias": w.pop(p + "input_layernorm.bias"),
            "qkv": regroup(w.pop(a + "query_key_value.weight")),
            "qkv_bias": regroup(w.pop(a + "query_key_value.bias")),
            "o": w.pop(a + "dense.weight"),
            "o_bias": w.pop(a + "dense.bias"),
            "post_norm": w.pop(p + "post_attention_layernorm.weight"),
            "post_norm_bias": w.pop(p + "post_attention_layernorm.bias"),
            "fc": w.pop(p + "mlp.dense_h_to_4h.weight"),
            "fc_bias": w.pop(p + "mlp.dense_h_to_4h.bias"),
            "proj": w.pop(p + "mlp.dense_4h_to_h.weight"),
            "proj_bias": w.pop(p + "mlp.dense_4h_to_h.bias"),
        }

    def _qkv(self, i: int, layer: Layer, x: torch.Tensor) -> torch.Tensor:
        return self._project(i, "qkv", x, layer["qkv"], layer["qkv_bias"])

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden]: instead of the ids' embeddings
    ) -> torch.Tensor:
        """Hidden states after the final norm, ``[T, hidden]``."""
        ops, eps, post = self.ops, self.cfg.rms_norm_eps, self.alibi.residual_post_norm
        hidden = F.embedding(input_ids, self.embed) if inputs_embeds is None else inputs_embeds
        if self.embed_norm is not None:
            hidden = ops.layer_norm(hidden, self.embed_norm, self.embed_norm_bias, eps)[0]
        for i, layer, _, _, kv_cache, scales in self._per_layer(kv_caches):
            x = ops.layer_norm(hidden, layer["in_norm"], layer["in_norm_bias"], eps)[0]
            q, k, v = split_heads(self._qkv(i, layer, x), self.cfg)
            attn = self._attend(i, layer, q, k, v, kv_cache, scales, meta, None, alibi=self.slopes)
            hidden = (x if post else hidden) + attn
            x = ops.layer_norm(hidden, layer["post_norm"], layer["post_norm_bias"], eps)[0]
            hidden = (x if post else hidden) + self._ungated(layer, x, self.act)
        return ops.layer_norm(hidden, self.norm, self.norm_bias, eps)[0]


class MptForCausalLM(BloomForCausalLM):
    _RENAMES = (
        ("transformer.blocks.", "model.layers."),
        ("transformer.wte.", "model.embed_tokens."),
        ("transformer.wpe.", "model.embed_positions."),
        ("transformer.norm_f.", "model.norm."),
        ("lm_head.", "lm_head."),
    )
    WEIGHT_RENAMES = {"MptForCausalLM": _RENAMES, "MPTForCausalLM": _RENAMES}

    def _attention_scale(self) -> float:
        scale = self.cfg.alibi.softmax_scale if self.cfg.alibi else None
        return 1 / math.sqrt(self.cfg.hidden_size / self.cfg.num_heads) if scale is None else scale

    def _slopes(self) -> torch.Tensor:
        return mpt_alibi_slopes(self.cfg.num_heads, self.alibi.alibi_bias_max)

    def _setup(self, w: dict[str, torch.Tensor]) -> None:
        if "model.embed_positions.weight" in w:
            raise ValueError("MPT with learned_pos_emb weights (transformer.wpe) is not supported")
        super()._setup(w)
        self.act = F.gelu

    def _layer(self, w: dict[str, torch.Tensor], i: int) -> Layer:
        p = f"model.layers.{i}."
        return {
            "in_norm": w.pop(p + "norm_1.weight"),
            "in_norm_bias": None,
            "qkv": w.pop(p + "attn.Wqkv.weight"),
            "qkv_bias": None,
            "o": w.pop(p + "attn.out_proj.weight"),
            "o_bias": None,
            "post_norm": w.pop(p + "norm_2.weight"),
            "post_norm_bias": None,
            "fc": w.pop(p + "ffn.up_proj.weight"),
            "fc_bias": None,
            "proj": w.pop(p + "ffn.down_proj.weight"),
            "proj_bias": None,
        }

    def _qkv(self, i: int, layer: Layer, x: torch.Tensor) -> torch.Tensor:
        qkv = self._project(i, "qkv", x, layer["qkv"])
        clip = self.alibi.clip_qkv
        return qkv if clip is None else qkv.clamp(min=-clip, max=clip)
