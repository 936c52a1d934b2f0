"""Config spellings of the ALiBi families, Bloom and MPT, read as ferry's: each config.json is rewritten
to the names ``ModelConfig.from_dict`` reads (``hidden_size``, ``num_hidden_layers``, ``layer_norm_eps``
…) with its transformers config class's defaults filled in; what the families add (the slopes' rule,
Bloom's residual option, MPT's attention options) is ``AlibiConfig``. An option whose model ferry
cannot compute exactly is a ValueError naming it, here, at load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# MPTForCausalLM: what MosaicML's hub configs name (their remote code); transformers' class is Mpt….
ALIBI_ARCHS = ("BloomForCausalLM", "MptForCausalLM", "MPTForCausalLM")


@dataclass(frozen=True)
class AlibiConfig:
    """A decoder whose positions are ALiBi biases (engine/attention/alibi.py) instead of rotary."""

    slopes: str  # "bloom" or "mpt": which rule gives the per-head slopes
    alibi_bias_max: float = 8.0  # MPT's rule: the last slope is 2 ** -alibi_bias_max
    # Bloom's apply_residual_connection_post_layernorm: the residual is the normed input, not the input.
    residual_post_norm: bool = False
    clip_qkv: float | None = None  # MPT: the fused q/k/v projection clamped to [-clip_qkv, clip_qkv]
    softmax_scale: float | None = None  # MPT: the attention scale (None: head_dim ** -0.5)


def alibi_config(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` (a config.json of one of ``ALIBI_ARCHS``) in the spellings ``ModelConfig`` reads."""
    return _bloom(raw) if raw["architectures"][0] == "BloomForCausalLM" else _mpt(raw)


def alibi_settings(raw: dict[str, Any]) -> AlibiConfig | None:
    """The ALiBi options of a config ``alibi_config`` rewrote; None for other models."""
    arch = (raw.get("architectures") or [""])[0]
    if arch == "BloomForCausalLM":
        return AlibiConfig(
            "bloom", residual_post_norm=bool(raw.get("apply_residual_connection_post_layernorm"))
        )
    if arch in ALIBI_ARCHS:
        attn = raw.get("attn_config") or {}
        clip, scale = attn.get("clip_qkv"), attn.get("softmax_scale")
        return AlibiConfig(
            "mpt",
            alibi_bias_max=float(attn.get("alibi_bias_max", 8)),
            clip_qkv=float(clip) if clip else None,
            softmax_scale=None if scale is None else float(scale),
        )
    return None


def _without_rope(out: dict[str, Any]) -> dict[str, Any]:
    for key in ("num_key_value_heads", "head_dim", "rope_parameters", "rope_scaling", "rope_theta"):
        out.pop(key, None)
    return out


def _bloom(raw: dict[str, Any]) -> dict[str, Any]:
    """BloomConfig's defaults (``n_embed``: the older spelling of the hidden size). Bloom has no
    position limit of its own (ALiBi); its training length, ``seq_length`` where a config keeps it
    (else 2048), bounds the context ferry serves by default."""
    hidden = int(raw.get("hidden_size") or raw.get("n_embed") or 64)
    return _without_rope(
        {
            "vocab_size": 250880,
            "eos_token_id": 2,
            "tie_word_embeddings": True,
            **raw,
            "hidden_size": hidden,
            "num_hidden_layers": int(raw.get("n_layer") or raw.get("num_hidden_layers") or 2),
            "num_attention_heads": int(raw.get("n_head") or raw.get("num_attention_heads") or 8),
            "intermediate_size": 4 * hidden,
            "max_position_embeddings": int(raw.get("seq_length") or 2048),
            "layer_norm_eps": float(raw.get("layer_norm_epsilon", 1e-5)),
            "hidden_act": "bloom_gelu",
            "attention_bias": True,
        }
    )


# MPT options whose other values change the model in ways ferry does not compute: field -> the
# value served. (transformers' MptForCausalLM ignores most of them and would give another model.)
_MPT_FIXED = {"no_bias": True, "logit_scale": None}
_MPT_ATTN_FIXED = {
    "alibi": True,
    "qk_ln": False,
    "prefix_lm": False,
    "attn_type": "multihead_attention",
}


def _mpt(raw: dict[str, Any]) -> dict[str, Any]:
    """MptConfig's defaults. ``expansion_ratio`` sizes the MLP; ``attn_config``'s ``clip_qkv``,
    ``softmax_scale`` and ``alibi_bias_max`` are served; the options in ``_MPT_FIXED`` /
    ``_MPT_ATTN_FIXED`` only at the values there."""
    attn = raw.get("attn_config") or {}
    for key, served in _MPT_FIXED.items():
        if raw.get(key, served) != served:
            raise ValueError(f"MPT with {key}={raw[key]!r} is not supported (only {served!r})")
    for key, served in _MPT_ATTN_FIXED.items():
        if attn.get(key, served) != served:
            raise ValueError(f"MPT with attn_config.{key}={attn[key]!r} is not supported (only {served!r})")
    if raw.get("norm_type", "low_precision_layernorm") not in ("layernorm", "low_precision_layernorm"):
        raise ValueError(f"MPT with norm_type={raw['norm_type']!r} is not supported (only LayerNorm)")
    hidden = int(raw.get("d_model") or raw.get("hidden_size") or 2048)
    return _without_rope(
        {
            "vocab_size": 50368,
            "tie_word_embeddings": True,
            **raw,
            "hidden_size": hidden,
            "num_hidden_layers": int(raw.get("n_layers") or raw.get("num_hidden_layers") or 24),
            "num_attention_heads": int(raw.get("n_heads") or raw.get("num_attention_heads") or 16),
            "intermediate_size": int(raw.get("expansion_ratio", 4) * hidden),
            "max_position_embeddings": int(raw.get("max_seq_len") or 2048),
            "layer_norm_eps": float(raw.get("layer_norm_epsilon", 1e-5)),
            "hidden_act": "gelu",
            "attention_bias": False,
        }
    )
