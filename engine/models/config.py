"""The model shape read from a Hugging Face ``config.json`` (both transformers 4 and 5 spellings)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None: plain rope; else has "rope_type" (linear | llama3 …)
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    checkpoint_dtype: str  # float32 | bfloat16 | float16
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None = None  # attention window (Mistral, Qwen2); None: full attention
    # Per layer: the window that layer attends within, or None for full attention. A query at
    # position q sees keys k with q - window < k <= q (transformers' sliding mask).
    layer_windows: tuple[int | None, ...] = ()

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(
                f"{model_dir} has no config.json; it is not a Hugging Face model directory"
            ) from None
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures") or []
        if not archs:
            raise ValueError("config.json names no 'architectures'")
        model_type = raw.get("model_type", "")
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        # transformers 5 folds rope_theta and rope_scaling into rope_parameters.
        rope = dict(raw.get("rope_parameters") or {})
        theta = float(raw.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        scaling = raw.get("rope_scaling") or rope or None
        if scaling is not None:
            scaling = dict(scaling)
            kind = scaling.get("rope_type") or scaling.get("type") or "default"
            scaling["rope_type"] = kind
            if kind == "default":
                scaling = None
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        dtype = str(raw.get("dtype") or raw.get("torch_dtype") or "float32").replace("torch.", "")
        if raw.get("mlp_bias"):
            raise ValueError("MLP biases (mlp_bias=true) are not supported")
        num_layers = int(raw["num_hidden_layers"])
        window, layer_windows = _sliding_windows(raw, model_type, num_layers)
        return cls(
            architecture=archs[0],
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
            checkpoint_dtype=dtype,
            eos_token_ids=eos_ids,
            sliding_window=window,
            layer_windows=layer_windows,
        )


def _sliding_windows(
    raw: dict[str, Any], model_type: str, num_layers: int
) -> tuple[int | None, tuple[int | None, ...]]:
    """The model's window and each layer's, as transformers reads them (defaults included)."""
    if model_type == "llama":
        return None, (None,) * num_layers  # transformers' Llama ignores a sliding_window entry
    # MistralConfig and Qwen2Config both default a missing sliding_window to 4096.
    window = raw.get("sliding_window", 4096 if model_type in ("mistral", "qwen2") else None)
    if model_type == "qwen2" and not raw.get("use_sliding_window", False):
        window = None  # Qwen2 configs carry a window size but only use it when told to
    if not window:
        return None, (None,) * num_layers
    window = int(window)
    if model_type != "qwen2":
        return window, (window,) * num_layers
    # Qwen2: transformers 5 lists layer types; older configs window the layers from
    # max_window_layers on.
    types = raw.get("layer_types")
    if types is None:
        first = int(raw.get("max_window_layers", 28))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
    return window, tuple(window if t == "sliding_attention" else None for t in types)
