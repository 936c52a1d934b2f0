"""Gemma 1, 2 and 3 text decoders over the paged KV cache: ``GemmaForCausalLM``, ``Gemma2ForCausalLM``,
``Gemma3ForCausalLM`` (1B), and the language model of ``Gemma3ForConditionalGeneration`` checkpoints
(4B-27B) served text-only.

Differences from the Llama family, all as transformers computes them:
* embeddings scaled by ``sqrt(hidden_size)`` (the factor rounded to the model dtype);
* RMSNorm weights are offsets: the norm multiplies by ``1 + weight`` (folded in at load time);
* Gemma 2/3's sandwich norms: the attention and MLP outputs are normalised again before the residual
  add (Gemma 1 has Llama's two norms per layer);
* Gemma 3: per-head RMSNorm of q and k before rotary; queries scaled by ``query_pre_attn_scalar ** -0.5``;
* Gemma 2: attention scores soft-capped (``cap * tanh(score / cap)``, the attention backends do it);
* local (sliding-window) and global layers, each kind with its own rotary table;
* a GELU (tanh approximation) gated MLP; optionally soft-capped final logits.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionMetadata
from engine.models.config import ModelConfig
from engine.models.decoder import DecoderBase, KVCache, Layer
from engine.models.rope import build_cos_sin_cache


class GemmaForCausalLM(DecoderBase):
    # A multimodal checkpoint served text-only: its language model's weights, not its vision tower.
    WEIGHT_RENAMES = {
        "Gemma3ForConditionalGeneration": (
            ("language_model.model.", "model."),  # transformers 4's layout (the hub's)
            ("model.language_model.", "model."),  # transformers 5's
            ("language_model.lm_head.", "lm_head."),
            ("lm_head.", "lm_head."),
        )
    }

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], **options: Any) -> None:
        if cfg.gemma is None:
            raise ValueError(f"{cfg.architecture} needs a gemma, gemma2 or gemma3_text config")
        self.gemma = cfg.gemma
        self.softcap = cfg.gemma.attn_logit_softcapping
        super().__init__(cfg, weights, **options)

    def _attention_scale(self) -> float:
        return self.gemma.query_pre_attn_scalar**-0.5

    def _rotary_tables(self, max_positions: int, device: torch.device) -> list[torch.Tensor | None]:
        """One table per distinct (theta, scaling) of the layers' (local and global layers differ)."""
        tables: dict[tuple, torch.Tensor] = {}
        for theta, scaling in self.gemma.layer_rope:
            key = (theta, repr(sorted((scaling or {}).items())))
            if key not in tables:
                tables[key] = build_cos_sin_cache(self.cfg.head_dim, max_positions, theta, scaling, device)
        return [tables[(theta, repr(sorted((s or {}).items())))] for theta, s in self.gemma.layer_rope]

    def _setup(self, w: dict[str, torch.Tensor]) -> None:
        # transformers multiplies by the factor as a tensor of the weights' dtype.
        self.embed_scale = torch.tensor(math.sqrt(self.cfg.hidden_size), dtype=self.embed.dtype).item()
        self.norm = _offset(self.norm)

    @staticmethod
    def _layer(w: dict[str, torch.Tensor], i: int) -> Layer:
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        if p + "pre_feedforward_layernorm.weight" in w:  # Gemma 2/3: sandwich norms
            norms = {
                "post_attn_norm": _offset(w[p + "post_attention_layernorm.weight"]),
                "pre_ff_norm": _offset(w[p + "pre_feedforward_layernorm.weight"]),
                "post_ff_norm": _offset(w[p + "post_feedforward_layernorm.weight"]),
            }
        else:  # Gemma 1: post_attention_layernorm is the MLP's input norm, as in Llama
            norms = {"pre_ff_norm": _offset(w[p + "post_attention_layernorm.weight"])}
        return {
            "in_norm": _offset(w[p + "input_layernorm.weight"]),
            **norms,
            "qkv": torch.cat([w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]]),
            # Gemma 3 normalises q and k per head; Gemma 2 does not
            **(
                {"q_norm": _offset(w[a + "q_norm.weight"]), "k_norm": _offset(w[a + "k_norm.weight"])}
                if a + "q_norm.weight" in w
                else {}
            ),
            "o": w[a + "o_proj.weight"],
            "gate_up": torch.cat([w[m + "gate_proj.weight"], w[m + "up_proj.weight"]]),
            "down": w[m + "down_proj.weight"],
        }

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The ids' input embeddings ``[T, hidden]``, scaled, as transformers' ``get_input_embeddings()``
        gives them (what prompt embeddings and image features stand in for; a fresh tensor)."""
        return F.embedding(input_ids, self.embed) * self.embed_scale

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
        # transformers' scaled embedding layer includes the factor: given embeddings have it.
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual: torch.Tensor | None = None
        t = input_ids.shape[0]
        for i, layer, window, cos_sin, kv_cache, scales in self._per_layer(kv_caches):
            x, residual = ops.rms_norm(hidden, layer["in_norm"], eps, residual)
            if residual is None:
                residual = hidden
            qkv = self._project(i, "qkv", x, layer["qkv"])
            q = qkv[:, : self.q_size].reshape(-1, d)
            k = qkv[:, self.q_size : self.q_size + self.kv_size].reshape(-1, d)
            if "q_norm" in layer:
                q, k = ops.rms_norm(q, layer["q_norm"], eps)[0], ops.rms_norm(k, layer["k_norm"], eps)[0]
            q, k = q.view(t, cfg.num_heads, d).contiguous(), k.view(t, cfg.num_kv_heads, d).contiguous()
            v = qkv[:, self.q_size + self.kv_size :].reshape(t, cfg.num_kv_heads, d)
            ops.rotary_embedding(positions, q, k, cos_sin)
            out = self._attend(i, layer, q, k, v, kv_cache, scales, meta, window, self.softcap)
            if "post_attn_norm" in layer:
                out = ops.rms_norm(out, layer["post_attn_norm"], eps)[0]
            x, residual = ops.rms_norm(out, layer["pre_ff_norm"], eps, residual)
            out = self._gelu_mlp(i, layer, x)
            hidden = ops.rms_norm(out, layer["post_ff_norm"], eps)[0] if "post_ff_norm" in layer else out
        out, _ = ops.rms_norm(hidden, self.norm, eps, residual)
        return out

    def _gelu_mlp(self, i: int, layer: Layer, x: torch.Tensor) -> torch.Tensor:
        """``down(gelu_tanh(gate(x)) * up(x))``, with LoRA."""
        gate, up = self._project(i, "gate_up", x, layer["gate_up"]).chunk(2, dim=-1)
        return self._project(i, "down", F.gelu(gate, approximate="tanh") * up, layer["down"])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[N, vocab]``, soft-capped when the config says so."""
        logits = super().compute_logits(hidden)
        cap = self.gemma.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


def _offset(weight: torch.Tensor) -> torch.Tensor:
    """Gemma's RMSNorm multiplies by ``1 + weight`` (computed in fp32, as transformers does)."""
    return (1.0 + weight.float()).to(weight.dtype)
