"""``FalconForCausalLM`` (Falcon 7B/40B/180B, Falcon 2 11B) over the paged KV cache, as transformers
5 computes it, on ``LayerNormDecoder``'s forward (engine/models/layernorm_decoder.py). Falcon 3 is a
Llama checkpoint (``LlamaForCausalLM``) and is served as one.

``query_key_value`` holds, per K/V head, that group's query heads, then its key, then its value:
``[kv_heads, heads / kv_heads + 2, head_dim]`` rows. The three layouts transformers reads are that
one: the new decoder architecture (Falcon 40B/180B: ``num_kv_heads`` groups), multi-query (Falcon
7B: one group of every query head, one K/V head) and neither (one group per head, GPT-NeoX's
per-head (q, k, v)). They are regrouped into all q, all k, all v at load.

A layer is parallel (``parallel_attn``; always with the new architecture): ``h + attn(x) + mlp(x')``
with ``x'`` from a second LayerNorm (``ln_mlp``, beside ``ln_attn``) when the new architecture has
``num_ln_in_parallel_attn`` 2 (its default), else ``x' = x`` (one ``input_layernorm``). Without
``parallel_attn`` it is sequential over ``input_layernorm`` and ``post_attention_layernorm``. Rotary
covers whole heads; ``bias`` puts biases on every projection (the MLP's too). ALiBi checkpoints
(``alibi=true``, Falcon-RW) are refused at load: transformers rounds their bias to bfloat16, unlike
Bloom's and MPT's fp32 ALiBi that ferry's backends compute.

transformers sums ``(mlp + attn) + h``, ferry ``(h + attn) + mlp``: fp32 agrees to rounding. Adapters
would target ``self_attention.query_key_value`` (outside engine/lora.py's ``self_attn|mlp`` key
pattern, and regrouped rows): ``--enable-lora`` is refused by name.
"""

from __future__ import annotations

import torch

from engine.models.decoder import Layer
from engine.models.layernorm_decoder import LayerNormDecoder

Weights = dict[str, torch.Tensor]


class FalconForCausalLM(LayerNormDecoder):
    WEIGHT_RENAMES = {
        "FalconForCausalLM": (
            ("transformer.word_embeddings.", "model.embed_tokens."),
            ("transformer.ln_f.", "model.norm."),
            ("transformer.h.", "model.layers."),
            ("lm_head.", "lm_head."),
        )
    }

    def _setup(self, w: Weights) -> None:
        self.two_norms = "model.layers.0.ln_attn.weight" in w  # the new architecture's ln_attn / ln_mlp
        super()._setup(w)

    def _residual_style(self) -> str:
        if self.two_norms:
            return "two_norms"
        return "shared" if self.cfg.parallel_residual else "sequential"

    def _regroup(self, t: torch.Tensor) -> torch.Tensor:
        """``query_key_value`` rows (weight or bias) per K/V group -> all q, all k, all v."""
        cfg = self.cfg
        groups, d = cfg.num_kv_heads, cfg.head_dim
        per = t.view(groups, cfg.num_heads // groups + 2, d, *t.shape[1:])
        rest = t.shape[1:]  # in features (a weight), none (a bias)
        return torch.cat([part.reshape(-1, *rest) for part in (per[:, :-2], per[:, -2], per[:, -1])])

    def _layer(self, w: Weights, i: int) -> Layer:
        p = f"model.layers.{i}."
        a, m = p + "self_attention.", p + "mlp."
        bias = w.pop(a + "query_key_value.bias", None)
        layer = {
            "qkv": self._regroup(w.pop(a + "query_key_value.weight")),
            "qkv_bias": None if bias is None else self._regroup(bias),
            "o": w.pop(a + "dense.weight"),
            "o_bias": w.pop(a + "dense.bias", None),
            "fc": w.pop(m + "dense_h_to_4h.weight"),
            "fc_bias": w.pop(m + "dense_h_to_4h.bias", None),
            "proj": w.pop(m + "dense_4h_to_h.weight"),
            "proj_bias": w.pop(m + "dense_4h_to_h.bias", None),
        }
        norms = (("ln_attn", "in_norm"), ("ln_mlp", "post_norm"))
        if not self.two_norms:
            norms = (("input_layernorm", "in_norm"), ("post_attention_layernorm", "post_norm"))
        for name, key in norms:
            if p + name + ".weight" in w:  # a parallel layer over one norm has no post_attention_layernorm
                layer[key], layer[key + "_bias"] = w.pop(p + name + ".weight"), w.pop(p + name + ".bias")
        return layer

    lora_layout = None  # type: ignore[assignment]  # --enable-lora is refused: see the module docstring
