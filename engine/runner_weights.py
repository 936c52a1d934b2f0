"""``ModelRunner``'s weights and KV cache over their lifetime: built from a checkpoint at start,
offloaded to host memory or dropped by sleep mode (``engine/sleep_mode.py``) and brought back,
replaced in place or rebuilt by a weight update, and the paged KV cache allocated and released
beside them. ``ModelRunner`` inherits ``RunnerWeights``; one step's forward stays in
``engine/model_runner.py``, which this never runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.attention.base import FP8_DTYPES
from engine.models.kv_scales import KVScales, take_kv_scales
from engine.runner_parts import allocate_kv, read_weights
from engine.sleep_mode import move_tensors
from engine.weight_update import tensor_pairs


class RunnerWeights:
    """``ModelRunner``'s weight and KV-cache lifecycle. Uses its ``config``, ``model_config``,
    ``device``, ``dtype``, ``kv_dtype``, ``block_size``, ``num_kv_blocks``, ``max_model_len``,
    ``classifier``, ``lora_adapters``, ``draft``, ``_model_cls``, ``_ops``, ``_attention`` and
    ``_fingerprint``; sets ``model``, ``score_head``, ``kv_scales``, ``kv_caches``, ``weights_id``
    and ``model_fingerprint``."""

    def read_weights(self, model_dir: Path, device: torch.device) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors as this model loads them (dtype, renames, dequantized), on ``device``."""
        return read_weights(model_dir, self.model_config, self.dtype, device, None, dummy=False)

    def install_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Build the model from loaded weights (moved to the device first); the previous model is
        replaced only once the new one is built. A draft kept in host memory while the weights were
        dropped (sleep level 2) comes back to the device with them."""
        weights, kv_scales = self._split_kv_scales(weights)
        self.model, head = self._build(weights, self.device, kv_scales)
        self.kv_scales = kv_scales
        if head is not None:
            self.score_head = head.float()
        self._move_draft(self.device)

    def replace_weights(self, weights: dict[str, torch.Tensor]) -> bool:
        """New weights of the serving model's shapes copied into its own tensors, one at a time, so
        the device never holds two models (a model that fills most of a GPU can be updated). The new
        model is built in host memory first (fused projections, derived tensors) and must hold
        tensors of the same shapes in the same places; False, with nothing changed, when it does not
        (``install_weights`` is then the way)."""
        host = torch.device("cpu")
        weights, kv_scales = self._split_kv_scales(weights)
        new, head = self._build(weights, host, kv_scales)
        pairs = tensor_pairs(self.model, new)
        if pairs is None or (head is None) != (self.score_head is None):
            return False
        if head is not None:
            pairs.append((self.score_head, head.float()))  # type: ignore[arg-type]
        with torch.inference_mode():
            for dst, src in pairs:
                dst.copy_(src)
        # The fp8 cache's scales are numbers, not tensors: the new model's replace the old ones.
        self.model.kv_scales, self.kv_scales = new.kv_scales, kv_scales
        return True

    def _split_kv_scales(
        self, weights: dict[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], KVScales | None]:
        """The weights without the KV cache's scale tensors (no model class sees them), and the
        scales an fp8 cache uses (``models/kv_scales.py``; None: none)."""
        weights = dict(weights)
        return weights, take_kv_scales(weights, self.model_config.num_layers, self.kv_dtype in FP8_DTYPES)

    def _build(
        self, weights: dict[str, torch.Tensor], device: torch.device, kv_scales: KVScales | None = None
    ) -> tuple[Any, torch.Tensor | None]:
        """(the model built from ``weights`` on ``device``, a classifier's score head or None)."""
        weights = {name: t.to(device) for name, t in weights.items()}
        head = weights.pop("score.weight", None) if self.classifier is not None else None
        model = self._model_cls(
            self.model_config,
            weights,
            ops=self._ops,
            attention=self._attention,
            deterministic=self.config.deterministic,
            max_positions=self.max_model_len,
            device=device,
            kv_scales=kv_scales,
        )
        return model, head

    def offload_weights(self) -> None:
        """Sleep level 1: the weights to host memory (where they already are on a CPU device); LoRA
        adapters' device copies are dropped (their host copies stay loaded)."""
        self._drop_lora_copies()
        if self.device.type != "cpu":
            move_tensors(self.model, torch.device("cpu"))
            if self.score_head is not None:
                self.score_head = self.score_head.cpu()
            self._move_draft(torch.device("cpu"))
            _empty_device_cache(self.device)

    def restore_weights(self) -> None:
        if self.device.type != "cpu":
            move_tensors(self.model, self.device)
            if self.score_head is not None:
                self.score_head = self.score_head.to(self.device)
        self._move_draft(self.device)

    def discard_weights(self) -> None:
        """Sleep level 2: drop the weights (waking reads a checkpoint: ``install_weights``). A draft
        model's go to host memory instead: weight updates never change them."""
        self._drop_lora_copies()
        self.model = None
        self.score_head = None
        self._move_draft(torch.device("cpu"))
        _empty_device_cache(self.device)

    def _drop_lora_copies(self) -> None:
        if self.lora_adapters is not None:
            self.lora_adapters.clear()

    def _move_draft(self, device: torch.device) -> None:
        if self.draft is not None and self.device.type != "cpu":
            move_tensors(self.draft.model, device)

    def set_weights_id(self, new_id: str) -> None:
        self.weights_id = new_id
        self.model_fingerprint = self._fingerprint()

    def allocate_kv_cache(self) -> None:
        """The target's KV cache, and the draft model's beside it."""
        cfg = self.model_config
        self.kv_caches = allocate_kv(cfg, self.num_kv_blocks, self.block_size, self.kv_dtype, self.device)
        if self.draft is not None:
            self.draft.allocate(self.num_kv_blocks)

    def release_kv_cache(self) -> None:
        """Drop the KV cache tensors, the draft model's too (every cached block's content with them)."""
        self.kv_caches = []
        if self.draft is not None:
            self.draft.kv_caches = []
        _empty_device_cache(self.device)


def _empty_device_cache(device: torch.device) -> None:
    """Hand freed blocks of PyTorch's CUDA caching allocator back to the device (sleep mode's point)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
