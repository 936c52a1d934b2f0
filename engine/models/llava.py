"""LLaVA (``LlavaForConditionalGeneration``): a vision tower (CLIP's, or any vision model transformers
builds from ``vision_config``), a two-layer projector, and a Llama-family language model run by
``llama.py`` over the paged cache.

The vision tower is transformers' own class built from the config and given the checkpoint's
weights (a well-kept implementation; images are encoded once per request, not per token). The
model runner calls ``encode_image`` when a prefill chunk first reaches an image's placeholder run
and passes the features in as those positions' input embeddings; everything else is the text model.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM

_VISION = ("vision_tower.", "multi_modal_projector.")


class LlavaForConditionalGeneration(LlamaForCausalLM):
    # transformers 4 (the hub's llava-hf checkpoints) and 5 name the parts differently; the vision
    # tower's tensors end up as ``vision_tower.<name in transformers' vision model>``.
    WEIGHT_RENAMES = {
        "LlavaForConditionalGeneration": (
            ("language_model.model.", "model."),
            ("model.language_model.", "model."),
            ("language_model.lm_head.", "lm_head."),
            ("lm_head.", "lm_head."),
            ("model.vision_tower.vision_model.", "vision_tower."),
            ("vision_tower.vision_model.", "vision_tower."),
            ("model.vision_tower.", "vision_tower."),
            ("vision_tower.", "vision_tower."),
            ("model.multi_modal_projector.", "multi_modal_projector."),
            ("multi_modal_projector.", "multi_modal_projector."),
        )
    }

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], **options: Any) -> None:
        if cfg.vision is None:
            raise ValueError("a LLaVA model needs its vision settings (config.json vision_config)")
        vision = {name: weights.pop(name) for name in [n for n in weights if n.startswith(_VISION)]}
        super().__init__(cfg, weights, **options)
        self.vision = cfg.vision
        self.tower = _vision_tower(cfg.vision.vision_config, vision, options["device"])
        p = "multi_modal_projector."
        self.proj1 = (vision.pop(p + "linear_1.weight"), vision.pop(p + "linear_1.bias", None))
        self.proj2 = (vision.pop(p + "linear_2.weight"), vision.pop(p + "linear_2.bias", None))
        from transformers.activations import ACT2FN

        self.proj_act = ACT2FN[cfg.vision.projector_act]

    @torch.inference_mode()
    def encode_image(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """One image's features ``[placeholder tokens, hidden]``, as transformers'
        ``LlavaModel.get_image_features``: the chosen hidden states of the vision tower (the CLS row
        dropped under the ``default`` strategy; several layers concatenated), then the projector."""
        vision = self.vision
        pixel_values = pixel_values.to(device=self.embed.device, dtype=self.embed.dtype)
        states = self.tower(pixel_values, output_hidden_states=True).hidden_states
        layers = vision.feature_layer if isinstance(vision.feature_layer, tuple) else (vision.feature_layer,)
        picked = [states[i] for i in layers]
        if vision.select_strategy == "default":
            picked = [h[:, 1:] for h in picked]
        features = torch.cat(picked, dim=-1)[0]
        hidden = self.proj_act(F.linear(features, *self.proj1))
        return F.linear(hidden, *self.proj2)


def _vision_tower(config: dict[str, Any], weights: dict[str, torch.Tensor], device: torch.device) -> Any:
    """transformers' vision model for ``config`` (``vision_config``) holding the checkpoint's
    ``vision_tower.*`` tensors, in their dtype, in eval mode."""
    from transformers import AutoConfig, AutoModel

    settings = {k: v for k, v in config.items() if k != "model_type"}
    tower_config = AutoConfig.for_model(config.get("model_type", "clip_vision_model"), **settings)
    tower = AutoModel.from_config(tower_config)
    expected = set(tower.state_dict())
    prefix = "vision_model." if expected and all(k.startswith("vision_model.") for k in expected) else ""
    state = {
        prefix + n.removeprefix("vision_tower."): t
        for n, t in weights.items()
        if n.startswith("vision_tower.")
    }
    missing = expected - set(state)
    # Position ids are a buffer transformers builds itself; nothing else may be left out.
    if any(not k.endswith("position_ids") for k in missing):
        raise ValueError(f"the checkpoint lacks vision tower weights: {sorted(missing)[:3]}")
    unexpected = tower.load_state_dict(state, strict=False).unexpected_keys
    if unexpected:
        raise ValueError(f"vision tower weights the model does not have: {sorted(unexpected)[:3]}")
    dtype = next(iter(state.values())).dtype
    return tower.to(device=device, dtype=dtype).eval()
