"""GPT-2 and OPT decoders (``GPT2LMHeadModel``, ``OPTForCausalLM``) over the paged KV cache.

Both add a learned absolute position embedding to the token embeddings (no rotary): the row of a
token's position, the position the runner passes in (so a prefill chunk or a prefix-cache hit
continues where the cached prefix ends). Both have LayerNorms with bias, full multi-head attention
with biased projections and an ungated MLP ``proj(act(fc(x)))``, as transformers computes them:

* GPT-2: pre-norm blocks; ``c_attn`` / ``c_proj`` / ``c_fc`` are ``Conv1D`` weights stored
  ``[in, out]`` (transposed at load); attention scaled by ``head_dim ** -0.5`` when
  ``scale_attn_weights`` (else 1) and divided by ``layer + 1`` with
  ``scale_attn_by_inverse_layer_idx``; ``gelu_new`` by default; the head tied to the embeddings.
  Checkpoints name tensors ``transformer.h.N…`` (or ``h.N…``, the hub's original files).
* OPT: position p reads embedding row ``p + 2``; queries are scaled before attention (transformers
  multiplies ``q_proj``'s output, then attends at scale 1); ``do_layer_norm_before`` false (OPT-350m)
  normalises after each block and has no final norm; ``word_embed_proj_dim`` narrower than the
  hidden size projects embeddings in (``project_in``) and the last hidden state out (``project_out``).

LoRA: OPT's attention takes adapters (``q_proj`` / ``k_proj`` / ``v_proj`` / ``out_proj``; its MLP's
``fc1`` / ``fc2`` none). GPT-2's take none: PEFT's adapters of its Conv1D modules (``fan_in_fan_out``)
are refused at load (engine/lora.py), and so is any other module name.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionMetadata
from engine.lora import ModuleSlot
from engine.models.activations import activation
from engine.models.config import AbsoluteConfig, ModelConfig
from engine.models.decoder import DecoderBase, KVCache, Layer, split_heads


class GPT2LMHeadModel(DecoderBase):
    WEIGHT_RENAMES = {
        "GPT2LMHeadModel": (
            ("transformer.h.", "model.layers."),
            ("transformer.wte.", "model.embed_tokens."),
            ("transformer.wpe.", "model.embed_positions."),
            ("transformer.ln_f.", "model.norm."),
            ("h.", "model.layers."),  # the hub's original GPT-2 files: no ``transformer.`` prefix
            ("wte.", "model.embed_tokens."),
            ("wpe.", "model.embed_positions."),
            ("ln_f.", "model.norm."),
            ("lm_head.", "lm_head."),
        )
    }

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], **options: Any) -> None:
        if cfg.absolute is None:
            raise ValueError(f"{cfg.architecture} needs learned position settings (a GPT-2 or OPT config)")
        self.absolute: AbsoluteConfig = cfg.absolute
        self.act = activation(cfg)
        super().__init__(cfg, weights, **options)

    def lora_layout(self) -> list[dict[str, ModuleSlot]]:
        """No projection of GPT-2 takes an adapter (see the module's docstring)."""
        return [{} for _ in self.layers]

    def _attention_scale(self) -> float:
        return self.cfg.head_dim**-0.5 if self.absolute.scale_attn_weights else 1.0

    def _rotary_tables(self, max_positions: int, device: torch.device) -> list[torch.Tensor | None]:
        return [None] * self.cfg.num_layers  # positions are embedded, not rotated

    def _setup(self, w: dict[str, torch.Tensor]) -> None:
        self.positions = w.pop("model.embed_positions.weight")
        self.norm_bias = w.pop("model.norm.bias", None)
        self.project_in: torch.Tensor | None = None  # OPT-350m's, from narrower embeddings
        # Per layer: GPT-2's scale, divided by (i + 1) when scale_attn_by_inverse_layer_idx, as
        # transformers divides its float.
        self.layer_scales = [
            self.scale / float(i + 1) if self.absolute.scale_by_inverse_layer else self.scale
            for i in range(self.cfg.num_layers)
        ]

    def _layer(self, w: dict[str, torch.Tensor], i: int) -> Layer:
        p = f"model.layers.{i}."
        return {
            "in_norm": w.pop(p + "ln_1.weight"),
            "in_norm_bias": w.pop(p + "ln_1.bias"),
            "qkv": w.pop(p + "attn.c_attn.weight").t().contiguous(),
            "qkv_bias": w.pop(p + "attn.c_attn.bias"),
            "o": w.pop(p + "attn.c_proj.weight").t().contiguous(),
            "o_bias": w.pop(p + "attn.c_proj.bias"),
            "post_norm": w.pop(p + "ln_2.weight"),
            "post_norm_bias": w.pop(p + "ln_2.bias"),
            "fc": w.pop(p + "mlp.c_fc.weight").t().contiguous(),
            "fc_bias": w.pop(p + "mlp.c_fc.bias"),
            "proj": w.pop(p + "mlp.c_proj.weight").t().contiguous(),
            "proj_bias": w.pop(p + "mlp.c_proj.bias"),
        }

    def _embed(
        self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None
    ) -> torch.Tensor:
        """Token (or given) embeddings, projected in where the model does, plus each position's
        learned embedding (its row ``position + position_offset``)."""
        hidden = F.embedding(input_ids, self.embed) if inputs_embeds is None else inputs_embeds
        if self.project_in is not None:
            hidden = self.linear(hidden, self.project_in, None)
        return hidden + F.embedding(positions + self.absolute.position_offset, self.positions)

    def _attention(
        self,
        i: int,
        layer: Layer,
        x: torch.Tensor,
        kv_cache: KVCache,
        scales: tuple[float, float],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Layer ``i``'s attention of its (normed) input through the output projection."""
        q, k, v = split_heads(self._project(i, "qkv", x, layer["qkv"], layer["qkv_bias"]), self.cfg)
        attn = self.attention.forward(
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
            *kv_cache,
            meta,
            self.layer_scales[i],
            k_scale=scales[0],
            v_scale=scales[1],
        )
        return self._project(i, "o", attn.reshape(x.shape[0], self.q_size), layer["o"], layer["o_bias"])

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden]: instead of the ids' embeddings
    ) -> torch.Tensor:
        """Hidden states after the final norm, ``[T, hidden]``."""
        ops, eps = self.ops, self.cfg.rms_norm_eps
        hidden = self._embed(input_ids, positions, inputs_embeds)
        for i, layer, _, _, kv_cache, scales in self._per_layer(kv_caches):
            x = ops.layer_norm(hidden, layer["in_norm"], layer["in_norm_bias"], eps)[0]
            hidden = hidden + self._attention(i, layer, x, kv_cache, scales, meta)
            x = ops.layer_norm(hidden, layer["post_norm"], layer["post_norm_bias"], eps)[0]
            hidden = hidden + self._ungated(layer, x, self.act)
        return ops.layer_norm(hidden, self.norm, self.norm_bias, eps)[0]


class OPTForCausalLM(GPT2LMHeadModel):
    WEIGHT_RENAMES = {
        "OPTForCausalLM": (
            ("model.decoder.layers.", "model.layers."),
            ("model.decoder.final_layer_norm.", "model.norm."),
            ("model.decoder.", "model."),
            ("decoder.layers.", "model.layers."),  # the hub's OPT files: no ``model.`` prefix
            ("decoder.final_layer_norm.", "model.norm."),
            ("decoder.", "model."),
            ("lm_head.", "lm_head."),
        )
    }

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], **options: Any) -> None:
        # Without a final norm (post-norm OPT) or its weight (layer_norm_elementwise_affine false) the
        # checkpoint has no ``final_layer_norm.weight``: an empty stand-in for the frame, replaced in _setup.
        weights.setdefault("model.norm.weight", torch.ones(0))
        super().__init__(cfg, weights, **options)

    def lora_layout(self) -> list[dict[str, ModuleSlot]]:
        """Attention's projections under OPT's names (``out_proj`` for the output)."""
        q, kv, hidden = self.q_size, self.kv_size, self.cfg.hidden_size
        slots: dict[str, ModuleSlot] = {
            "q_proj": ("qkv", 0, hidden, q),
            "k_proj": ("qkv", q, hidden, kv),
            "v_proj": ("qkv", q + kv, hidden, kv),
            "out_proj": ("o", 0, q, hidden),
        }
        return [dict(slots) for _ in self.layers]

    def _attention_scale(self) -> float:
        return 1.0  # queries are scaled before attention, as transformers scales them

    def _setup(self, w: dict[str, torch.Tensor]) -> None:
        super()._setup(w)
        self.q_scale = self.cfg.head_dim**-0.5
        self.project_in = w.pop("model.project_in.weight", None)
        self.project_out = w.pop("model.project_out.weight", None)
        if not self.absolute.final_norm:
            self.norm = None  # type: ignore[assignment]
        elif self.norm.numel() == 0:  # a final norm without weights
            self.norm = torch.ones(self.cfg.hidden_size, dtype=self.embed.dtype, device=self.embed.device)

    def _layer(self, w: dict[str, torch.Tensor], i: int) -> Layer:
        p = f"model.layers.{i}."
        a = p + "self_attn."
        cat = torch.cat
        qkv_bias = None
        if a + "q_proj.bias" in w:
            qkv_bias = cat([w.pop(a + f"{x}_proj.bias") for x in "qkv"])
        layer = {
            "qkv": cat([w.pop(a + f"{x}_proj.weight") for x in "qkv"]),
            "qkv_bias": qkv_bias,
            "o": w.pop(a + "out_proj.weight"),
            "o_bias": w.pop(a + "out_proj.bias", None),
            "fc": w.pop(p + "fc1.weight"),
            "fc_bias": w.pop(p + "fc1.bias", None),
            "proj": w.pop(p + "fc2.weight"),
            "proj_bias": w.pop(p + "fc2.bias", None),
        }
        ones = torch.ones(self.cfg.hidden_size, dtype=layer["qkv"].dtype, device=layer["qkv"].device)
        for key, name in (("in_norm", "self_attn_layer_norm"), ("post_norm", "final_layer_norm")):
            layer[key] = w.pop(p + name + ".weight", ones)  # no weight: layer_norm_elementwise_affine false
            layer[key + "_bias"] = w.pop(p + name + ".bias", None)
        return layer

    def _attention(
        self,
        i: int,
        layer: Layer,
        x: torch.Tensor,
        kv_cache: KVCache,
        scales: tuple[float, float],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self._project(i, "qkv", x, layer["qkv"], layer["qkv_bias"])
        q_size = self.q_size
        qkv = torch.cat([qkv[:, :q_size] * self.q_scale, qkv[:, q_size:]], dim=-1)
        q, k, v = split_heads(qkv, self.cfg)
        attn = self.attention.forward(
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
            *kv_cache,
            meta,
            1.0,
            k_scale=scales[0],
            v_scale=scales[1],
        )
        return self._project(i, "o", attn.reshape(x.shape[0], q_size), layer["o"], layer["o_bias"])

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [T, word_embed_proj_dim]: instead of the ids'
    ) -> torch.Tensor:
        """Hidden states after the final norm and ``project_out``, ``[T, word_embed_proj_dim]``."""
        ops, eps, pre = self.ops, self.cfg.rms_norm_eps, self.absolute.pre_norm
        hidden = self._embed(input_ids, positions, inputs_embeds)
        for i, layer, _, _, kv_cache, scales in self._per_layer(kv_caches):
            x = ops.layer_norm(hidden, layer["in_norm"], layer["in_norm_bias"], eps)[0] if pre else hidden
            hidden = hidden + self._attention(i, layer, x, kv_cache, scales, meta)
            if not pre:
                hidden = ops.layer_norm(hidden, layer["in_norm"], layer["in_norm_bias"], eps)[0]
            x = ops.layer_norm(hidden, layer["post_norm"], layer["post_norm_bias"], eps)[0] if pre else hidden
            hidden = hidden + self._ungated(layer, x, self.act)
            if not pre:
                hidden = ops.layer_norm(hidden, layer["post_norm"], layer["post_norm_bias"], eps)[0]
        if self.norm is not None:
            hidden = ops.layer_norm(hidden, self.norm, self.norm_bias, eps)[0]
        if self.project_out is not None:
            hidden = self.linear(hidden, self.project_out, None)
        return hidden
