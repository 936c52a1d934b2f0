"""What a Llama 4 text model adds to ``ModelConfig``, read as transformers 5's ``Llama4TextConfig``
reads config.json (its defaults filled in for fields a checkpoint leaves out)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LLAMA4_ARCHS = ("Llama4ForCausalLM", "Llama4ForConditionalGeneration")

# Llama4TextConfig's defaults for what the model code reads (Llama-4-Scout's values).
_DEFAULTS: dict[str, Any] = {
    "model_type": "llama4_text",
    "vocab_size": 202048,
    "hidden_size": 5120,
    "intermediate_size": 8192,
    "intermediate_size_mlp": 16384,
    "num_hidden_layers": 48,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 4096 * 32,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "num_experts_per_tok": 1,
    "num_local_experts": 16,
    "interleave_moe_layer_step": 1,
    "use_qk_norm": True,
    "no_rope_layer_interval": 4,
    "attention_chunk_size": 8192,
    "attn_temperature_tuning": True,
    "floor_scale": 8192,
    "attn_scale": 0.1,
    "attention_bias": False,
}


@dataclass(frozen=True)
class Llama4Config:
    """Per layer: whether it has rotary (``rope_layers``; a NoPE layer has none), its attention chunk
    (None: full causal attention), whether its MLP is the mixture of experts; and the model-wide
    settings of those parts."""

    rope_layers: tuple[bool, ...]
    layer_chunks: tuple[int | None, ...]
    moe_layers: tuple[bool, ...]
    use_qk_norm: bool  # a weightless RMSNorm of q and k after rotary, on the rope layers
    # NoPE layers' queries scaled by ``log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1``.
    temperature_tuning: tuple[float, float] | None  # (floor_scale, attn_scale); None: off
    num_experts: int
    experts_per_token: int
    intermediate_size_mlp: int  # the dense layers' MLP width (the experts' is intermediate_size)


def llama4_text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The text model's config with Llama4TextConfig's defaults filled in; for a multimodal checkpoint
    (Llama4ForConditionalGeneration) its ``text_config``, served text-only."""
    text = raw.get("text_config") or raw
    keys = (
        "architectures",
        "eos_token_id",
        "dtype",
        "torch_dtype",
        "quantization_config",
        "tie_word_embeddings",
    )
    top = {k: raw[k] for k in keys if raw.get(k) is not None}
    merged = {**_DEFAULTS, **text, **top}
    merged["model_type"] = "llama4_text"
    if not merged.get("rope_theta") and not (merged.get("rope_parameters") or {}).get("rope_theta"):
        merged["rope_theta"] = 500000.0  # Llama4TextConfig.default_theta
    return merged


def llama4(raw: dict[str, Any], num_layers: int) -> Llama4Config | None:
    """Llama 4's layer pattern as ``Llama4TextConfig.__post_init__`` derives it from config.json."""
    if raw.get("model_type") != "llama4_text":
        return None
    interval = int(raw.get("no_rope_layer_interval") or 4)
    flags = raw.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(num_layers)]
    step = int(raw.get("interleave_moe_layer_step") or 1)
    moe = raw.get("moe_layers")
    moe = list(range(step - 1, num_layers, step)) if moe is None else moe
    chunk = raw.get("attention_chunk_size")
    types = raw.get("layer_types") or [
        "chunked_attention" if flag and chunk is not None else "full_attention" for flag in flags
    ]
    if len(flags) != num_layers or len(types) != num_layers:
        raise ValueError(f"no_rope_layers / layer_types must list {num_layers} layers")
    if unknown := set(types) - {"chunked_attention", "full_attention"}:
        raise ValueError(f"unsupported Llama 4 layer_types {sorted(unknown)}")
    if "chunked_attention" in types and (chunk is None or int(chunk) < 1):
        raise ValueError(f"chunked_attention layers need an attention_chunk_size >= 1, got {chunk!r}")
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"Llama 4 with hidden_act {raw['hidden_act']!r} is not supported (silu only)")
    tuning = raw.get("attn_temperature_tuning")
    return Llama4Config(
        rope_layers=tuple(bool(flag) for flag in flags),
        layer_chunks=tuple(int(chunk) if t == "chunked_attention" else None for t in types),
        moe_layers=tuple(i in moe for i in range(num_layers)),
        use_qk_norm=bool(raw.get("use_qk_norm")),
        temperature_tuning=(float(raw["floor_scale"]), float(raw["attn_scale"])) if tuning else None,
        num_experts=int(raw["num_local_experts"]),
        experts_per_token=int(raw["num_experts_per_tok"]),
        intermediate_size_mlp=int(raw["intermediate_size_mlp"]),
    )
