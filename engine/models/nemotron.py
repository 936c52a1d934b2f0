"""Nemotron decoder (``NemotronForCausalLM``: Nemotron-4, Minitron) over the paged KV cache.

StarCoder2's layout (pre-norm LayerNorms with bias, an ungated MLP), as transformers computes
Nemotron: its LayerNorm1p multiplies by ``1 + weight`` (folded into the weights at load, in their
dtype, as transformers adds the one), only the first ``partial_rotary_factor`` (a half by default) of
each head's dims rotate, the MLP is ``down_proj(relu(up_proj(x)) ** 2)`` (``relu2``), biases where
``attention_bias`` / ``mlp_bias`` put them, and the head is untied. LoRA adapters reach attention's
projections (the ungated MLP takes none).
"""

from __future__ import annotations

import torch

from engine.models.decoder import Layer
from engine.models.starcoder2 import Starcoder2ForCausalLM


class NemotronForCausalLM(Starcoder2ForCausalLM):
    def _setup(self, w: dict[str, torch.Tensor]) -> None:
        super()._setup(w)
        self.norm = self.norm + 1.0

    @staticmethod
    def _layer(w: dict[str, torch.Tensor], i: int) -> Layer:
        m = f"model.layers.{i}.mlp."
        for ours, theirs in (("c_fc", "up_proj"), ("c_proj", "down_proj")):
            for part in ("weight", "bias"):
                if f"{m}{theirs}.{part}" in w:
                    w[f"{m}{ours}.{part}"] = w.pop(f"{m}{theirs}.{part}")
        layer = Starcoder2ForCausalLM._layer(w, i)
        layer["in_norm"] = layer["in_norm"] + 1.0
        layer["post_norm"] = layer["post_norm"] + 1.0
        return layer
