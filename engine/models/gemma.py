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

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.lora import LoRABatch, ModuleSlot
from engine.models.config import ModelConfig
from engine.models.kv_scales import KVScales, layer_scales
from engine.models.llama import Linear, dense_lora_layout, invariant_linear, take_embeddings
from engine.models.rope import build_cos_sin_cache
from engine.ops import Ops


class GemmaForCausalLM:
    # A multimodal checkpoint served text-only: its language model's weights, not its vision tower.
    WEIGHT_RENAMES = {
        "Gemma3ForConditionalGeneration": (
            ("language_model.model.", "model."),  # transformers 4's layout (the hub's)
            ("model.language_model.", "model."),  # transformers 5's
            ("language_model.lm_head.", "lm_head."),
            ("lm_head.", "lm_head."),
        )
    }

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
        if cfg.gemma is None:
            raise ValueError(f"{cfg.architecture} needs a gemma, gemma2 or gemma3_text config")
        self.cfg, self.gemma = cfg, cfg.gemma
        self.ops = ops
        self.attention = attention
        self.linear: Linear = invariant_linear if deterministic else F.linear
        self.scale = self.gemma.query_pre_attn_scalar**-0.5
        self.softcap = self.gemma.attn_logit_softcapping
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        tables: dict[tuple, torch.Tensor] = {}  # one table per distinct (theta, scaling)
        self.cos_sin = []
        for theta, scaling in self.gemma.layer_rope:
            key = (theta, repr(sorted((scaling or {}).items())))
            if key not in tables:
                tables[key] = build_cos_sin_cache(cfg.head_dim, max_positions, theta, scaling, device)
            self.cos_sin.append(tables[key])
        self.embed, norm, self.lm_head = take_embeddings(weights, cfg)
        # transformers multiplies by the factor as a tensor of the weights' dtype.
        self.embed_scale = torch.tensor(math.sqrt(cfg.hidden_size), dtype=self.embed.dtype).item()
        self.norm = _offset(norm)
        self.layers = [self._layer(weights, i) for i in range(cfg.num_layers)]
        self.windows = cfg.layer_windows or (None,) * cfg.num_layers
        self.kv_scales = layer_scales(kv_scales, cfg.num_layers)  # the fp8 cache's (k, v) scales
        # The step's LoRA adapters (engine/lora.py), set by the model runner before each forward.
        self.lora: LoRABatch | None = None

    def lora_layout(self) -> list[dict[str, ModuleSlot]]:
        return dense_lora_layout(self.layers, self.q_size, self.kv_size, self.cfg.hidden_size)

    @staticmethod
    def _layer(w: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
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
        """The ids' input embeddings ``[T, hidden]``, as transformers' ``get_input_embeddings()``
        gives them (what prompt embeddings and image features stand in for; a fresh tensor)."""
        return F.embedding(input_ids, self.embed) * self.embed_scale

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
        # transformers' scaled embedding layer includes the factor: given embeddings have it.
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual: torch.Tensor | None = None
        t = input_ids.shape[0]
        layers = zip(self.layers, self.windows, self.cos_sin, kv_caches, self.kv_scales, strict=True)
        lora = self.lora
        for i, (layer, window, cos_sin, (k_cache, v_cache), (k_scale, v_scale)) in enumerate(layers):
            x, residual = ops.rms_norm(hidden, layer["in_norm"], eps, residual)
            if residual is None:
                residual = hidden
            qkv = linear(x, layer["qkv"], None)
            if lora is not None:
                lora.add(i, "qkv", x, qkv)
            q = qkv[:, : self.q_size].reshape(-1, d)
            k = qkv[:, self.q_size : self.q_size + self.kv_size].reshape(-1, d)
            if "q_norm" in layer:
                q, k = ops.rms_norm(q, layer["q_norm"], eps)[0], ops.rms_norm(k, layer["k_norm"], eps)[0]
            q, k = q.view(t, cfg.num_heads, d).contiguous(), k.view(t, cfg.num_kv_heads, d).contiguous()
            v = qkv[:, self.q_size + self.kv_size :].reshape(t, cfg.num_kv_heads, d).contiguous()
            ops.rotary_embedding(positions, q, k, cos_sin)
            attn = self.attention.forward(
                q,
                k,
                v,
                k_cache,
                v_cache,
                meta,
                self.scale,
                window,
                self.softcap,
                k_scale=k_scale,
                v_scale=v_scale,
            )
            attn = attn.reshape(t, self.q_size)
            out = linear(attn, layer["o"], None)
            if lora is not None:
                lora.add(i, "o", attn, out)
            if "post_attn_norm" in layer:
                out = ops.rms_norm(out, layer["post_attn_norm"], eps)[0]
            x, residual = ops.rms_norm(out, layer["pre_ff_norm"], eps, residual)
            gate_up = linear(x, layer["gate_up"], None)
            if lora is not None:
                lora.add(i, "gate_up", x, gate_up)
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.gelu(gate, approximate="tanh") * up
            out = linear(act, layer["down"], None)
            if lora is not None:
                lora.add(i, "down", act, out)
            hidden = ops.rms_norm(out, layer["post_ff_norm"], eps)[0] if "post_ff_norm" in layer else out
        out, _ = ops.rms_norm(hidden, self.norm, eps, residual)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[N, vocab]``, soft-capped when the config says so."""
        logits = self.linear(hidden, self.lm_head, None).float()
        cap = self.gemma.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


def _offset(weight: torch.Tensor) -> torch.Tensor:
    """Gemma's RMSNorm multiplies by ``1 + weight`` (computed in fp32, as transformers does)."""
    return (1.0 + weight.float()).to(weight.dtype)
