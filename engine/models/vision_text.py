"""The language model of vision-language checkpoints served text-only: ``Mistral3ForConditionalGeneration``
(Mistral Small 3.1 / 3.2: a Mistral text model beside a Pixtral vision tower),
``Qwen2VLForConditionalGeneration`` and ``Qwen2_5_VLForConditionalGeneration`` (Qwen2's, with q/k/v
bias), ``Qwen3VLForConditionalGeneration`` (Qwen3's, per-head q/k norm) and
``Qwen3VLMoeForConditionalGeneration`` (Qwen3-MoE's), each run by ``llama.py``'s decoder.

Only the language model's tensors are read (``WEIGHT_RENAMES``; the vision tower, the projector or
merger and Qwen3-VL's deepstack mergers are skipped), and a chat message carrying an image is a 400
(``ModelConfig.vision`` is None). Their M-RoPE, for text, is ordinary rotary: see
engine/models/config_vision_text.py.
"""

from __future__ import annotations

import torch

from engine.models.decoder import Layer
from engine.models.llama import LlamaForCausalLM

# Every layout these checkpoints come in: transformers 4's (``language_model.model.`` for Mistral 3;
# ``model.`` beside ``visual.`` for Qwen2-VL / Qwen2.5-VL), transformers 5's and Qwen3-VL's
# (``model.language_model.``), the head as ``lm_head.`` or ``language_model.lm_head.``.
_RENAMES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.layers.", "model.layers."),
    ("model.embed_tokens.", "model.embed_tokens."),
    ("model.norm.", "model.norm."),
    ("lm_head.", "lm_head."),
)


class VisionTextForCausalLM(LlamaForCausalLM):
    WEIGHT_RENAMES = {
        arch: _RENAMES
        for arch in (
            "Mistral3ForConditionalGeneration",
            "Qwen2VLForConditionalGeneration",
            "Qwen2_5_VLForConditionalGeneration",
            "Qwen3VLForConditionalGeneration",
            "Qwen3VLMoeForConditionalGeneration",
        )
    }

    def _layer(self, w: dict[str, torch.Tensor], i: int) -> Layer:
        if self.moe is not None:
            _experts_in_memory_layout(w, f"model.layers.{i}.mlp.experts.", self.cfg.hidden_size)
        return super()._layer(w, i)


def _experts_in_memory_layout(w: dict[str, torch.Tensor], prefix: str, hidden: int) -> None:
    """Qwen3-VL-MoE's released checkpoints store each layer's fused experts transposed, as
    ``gate_up_proj`` [E, hidden, 2I] and ``down_proj`` [E, I, hidden]; transformers (and ``moe.py``)
    hold [E, 2I, hidden] and [E, hidden, I]. As transformers' loader does, a tensor is transposed
    unless it already has the in-memory shape (which transformers 5's ``save_pretrained`` writes)."""
    gate_up, down = prefix + "gate_up_proj", prefix + "down_proj"
    if gate_up not in w:
        return
    if w[gate_up].shape[2] != hidden:
        w[gate_up] = w[gate_up].transpose(1, 2).contiguous()
    if w[down].shape[1] != hidden:
        w[down] = w[down].transpose(1, 2).contiguous()
