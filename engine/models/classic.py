"""The classic LayerNorm decoders over the paged KV cache, each as transformers 5 computes it (the
forward they share is ``LayerNormDecoder``'s, engine/models/layernorm_decoder.py):

* ``GPTNeoXForCausalLM`` (Pythia, GPT-NeoX-20B): ``query_key_value`` stored per head as (q, k, v)
  and regrouped into all q, all k, all v at load; partial rotary (``rotary_pct``); two LayerNorms
  per layer, both on the layer's input with ``use_parallel_residual`` (else one after attention);
  a GELU MLP and every projection with biases (``attention_bias``); the head is ``embed_out``.
* ``PhiForCausalLM`` (phi-1, phi-1.5, phi-2): attention and MLP side by side on one LayerNorm,
  partial rotary, biases everywhere, optional ``qk_layernorm`` (one LayerNorm shared by the heads),
  a final LayerNorm and an LM head with bias.
* ``StableLmForCausalLM`` (StableLM 2, Zephyr): partial rotary, optional q/k/v biases
  (``use_qkv_bias``) and per-head q/k LayerNorm (``qk_layernorm``, a weight per head, no bias),
  ``use_parallel_residual``, SwiGLU.
* ``GPTJForCausalLM``: rotary over interleaved pairs of the first ``rotary_dim`` dims (base 10000),
  attention and MLP side by side on one LayerNorm, no attention biases, an LM head with bias.
  transformers runs GPT-J's attention scores in fp32 whatever the model dtype; ferry's attention
  backends run theirs as for every other model (the same in fp32).
* ``OlmoForCausalLM`` (OLMo 1, allenai/OLMo-*-hf): Llama's layout and SwiGLU with LayerNorms that
  have neither weight nor bias (epsilon fixed at 1e-5, whatever the config says), a sequential
  residual, optional biases on q/k/v/o (``attention_bias``) and ``clip_qkv`` (the projections
  clamped). It takes LoRA on attention and its MLP.

GPT-NeoX's and GPT-J's adapters name their modules outside ``…layers.N.self_attn|mlp`` (the key
pattern of engine/lora.py), and GPT-NeoX's fused ``query_key_value`` would need its adapter's rows
regrouped as the weight's are: those two take no LoRA (``--enable-lora`` is refused by name). Phi and
StableLM take adapters on attention (``dense`` is Phi's ``o_proj``), StableLM on its SwiGLU MLP too.
"""

from __future__ import annotations

import torch

from engine.lora import ModuleSlot
from engine.models.decoder import Layer
from engine.models.layernorm_decoder import LayerNormDecoder
from engine.models.moe import load_dense_mlp

Weights = dict[str, torch.Tensor]


def _qkv(w: Weights, a: str, names: str = "qkv") -> tuple[torch.Tensor, torch.Tensor | None]:
    """Separate q/k/v projections at ``a`` fused (weight, bias or None)."""
    weight = torch.cat([w.pop(a + f"{x}_proj.weight") for x in names])
    bias = None
    if a + "q_proj.bias" in w:
        bias = torch.cat([w.pop(a + f"{x}_proj.bias") for x in names])
    return weight, bias


def _ungated(w: Weights, fc: str, proj: str) -> Layer:
    return {
        "fc": w.pop(fc + ".weight"),
        "fc_bias": w.pop(fc + ".bias"),
        "proj": w.pop(proj + ".weight"),
        "proj_bias": w.pop(proj + ".bias"),
    }


def _norm(w: Weights, prefix: str, key: str) -> Layer:
    return {key: w.pop(prefix + ".weight"), key + "_bias": w.pop(prefix + ".bias", None)}


class GPTNeoXForCausalLM(LayerNormDecoder):
    WEIGHT_RENAMES = {
        "GPTNeoXForCausalLM": (
            ("gpt_neox.embed_in.", "model.embed_tokens."),
            ("gpt_neox.final_layer_norm.", "model.norm."),
            ("gpt_neox.layers.", "model.layers."),
            ("embed_out.", "lm_head."),
        )
    }

    def _residual_style(self) -> str:
        return "two_norms" if self.cfg.parallel_residual else "sequential"

    def _layer(self, w: Weights, i: int) -> Layer:
        p = f"model.layers.{i}."
        a, m = p + "attention.", p + "mlp."
        heads = self.cfg.num_heads

        def regroup(t: torch.Tensor) -> torch.Tensor:  # per head (q, k, v) -> all q, all k, all v
            return t.view(heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)

        bias = w.pop(a + "query_key_value.bias", None)
        return {
            **_norm(w, p + "input_layernorm", "in_norm"),
            **_norm(w, p + "post_attention_layernorm", "post_norm"),
            "qkv": regroup(w.pop(a + "query_key_value.weight")),
            "qkv_bias": None if bias is None else regroup(bias),
            "o": w.pop(a + "dense.weight"),
            "o_bias": w.pop(a + "dense.bias", None),
            **_ungated(w, m + "dense_h_to_4h", m + "dense_4h_to_h"),
        }

    lora_layout = None  # type: ignore[assignment]  # --enable-lora is refused: see the module docstring


class PhiForCausalLM(LayerNormDecoder):
    WEIGHT_RENAMES = {
        "PhiForCausalLM": (
            ("model.final_layernorm.", "model.norm."),
            ("model.", "model."),
            ("lm_head.", "lm_head."),
        )
    }

    def _layer(self, w: Weights, i: int) -> Layer:
        p = f"model.layers.{i}."
        a = p + "self_attn."
        qkv, qkv_bias = _qkv(w, a)
        layer = {
            **_norm(w, p + "input_layernorm", "in_norm"),
            "qkv": qkv,
            "qkv_bias": qkv_bias,
            "o": w.pop(a + "dense.weight"),
            "o_bias": w.pop(a + "dense.bias"),
            **_ungated(w, p + "mlp.fc1", p + "mlp.fc2"),
        }
        if a + "q_layernorm.weight" in w:  # qk_layernorm: one [head_dim] LayerNorm for all heads
            layer.update(_norm(w, a + "q_layernorm", "q_norm"), **_norm(w, a + "k_layernorm", "k_norm"))
        return layer

    def lora_layout(self) -> list[dict[str, ModuleSlot]]:
        """Attention's projections, ``dense`` being Phi's name for ``o_proj``."""
        layouts = super().lora_layout()
        for slots in layouts:
            slots["dense"] = slots["o_proj"]
        return layouts


class StableLmForCausalLM(LayerNormDecoder):
    GATED = True

    def _residual_style(self) -> str:
        return "shared" if self.cfg.parallel_residual else "sequential"

    def _layer(self, w: Weights, i: int) -> Layer:
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        qkv, qkv_bias = _qkv(w, a)
        layer = {
            **_norm(w, p + "input_layernorm", "in_norm"),
            "qkv": qkv,
            "qkv_bias": qkv_bias,
            "o": w.pop(a + "o_proj.weight"),
            "gate_up": torch.cat([w.pop(m + "gate_proj.weight"), w.pop(m + "up_proj.weight")]),
            "down": w.pop(m + "down_proj.weight"),
        }
        if not self.cfg.parallel_residual:
            layer.update(_norm(w, p + "post_attention_layernorm", "post_norm"))
        if a + "q_layernorm.norms.0.weight" in w:  # qk_layernorm: a [head_dim] weight per head
            for x, n in (("q", self.cfg.num_heads), ("k", self.cfg.num_kv_heads)):
                norms = [w.pop(a + f"{x}_layernorm.norms.{h}.weight") for h in range(n)]
                layer[f"{x}_norm"], layer[f"{x}_norm_bias"] = torch.stack(norms), None
        return layer


class GPTJForCausalLM(LayerNormDecoder):
    ROPE_INTERLEAVE = True
    WEIGHT_RENAMES = {
        "GPTJForCausalLM": (
            ("transformer.wte.", "model.embed_tokens."),
            ("transformer.ln_f.", "model.norm."),
            ("transformer.h.", "model.layers."),
            ("lm_head.", "lm_head."),
        )
    }

    def _layer(self, w: Weights, i: int) -> Layer:
        p = f"model.layers.{i}."
        a = p + "attn."
        return {
            **_norm(w, p + "ln_1", "in_norm"),
            "qkv": _qkv(w, a)[0],
            "qkv_bias": None,
            "o": w.pop(a + "out_proj.weight"),
            **_ungated(w, p + "mlp.fc_in", p + "mlp.fc_out"),
        }

    lora_layout = None  # type: ignore[assignment]  # --enable-lora is refused: see the module docstring


class OlmoForCausalLM(LayerNormDecoder):
    GATED = True

    def _residual_style(self) -> str:
        return "sequential"

    def _layer(self, w: Weights, i: int) -> Layer:
        p = f"model.layers.{i}."
        a = p + "self_attn."
        qkv, qkv_bias = _qkv(w, a)
        no_weight = {"in_norm": None, "in_norm_bias": None, "post_norm": None, "post_norm_bias": None}
        return {
            **no_weight,
            "qkv": qkv,
            "qkv_bias": qkv_bias,
            "o": w.pop(a + "o_proj.weight"),
            "o_bias": w.pop(a + "o_proj.bias", None),
            **load_dense_mlp(w, p + "mlp."),
        }
