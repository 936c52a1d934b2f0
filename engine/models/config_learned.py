"""Config spellings of GPT-2, OPT, Nemotron and OLMoE read as ferry's: each config.json is rewritten to
the names ``ModelConfig.from_dict`` reads (``hidden_size``, ``num_hidden_layers``, ``intermediate_size``,
``layer_norm_eps``, ``hidden_act`` …), with its transformers config class's defaults filled in, before
it is read. What GPT-2 and OPT add (learned positions and their options) is ``AbsoluteConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LEARNED_ARCHS = ("GPT2LMHeadModel", "OPTForCausalLM", "NemotronForCausalLM", "OlmoeForCausalLM")


@dataclass(frozen=True)
class AbsoluteConfig:
    """A decoder with learned absolute position embeddings (GPT-2, OPT) instead of rotary."""

    position_offset: int  # OPT's embedding row of position p is p + 2; GPT-2's is p
    pre_norm: bool  # OPT's do_layer_norm_before (False: OPT-350m normalises after each block)
    # GPT-2's attention scale: head_dim ** -0.5 when scale_attn_weights (else 1), divided by
    # (layer index + 1) when scale_attn_by_inverse_layer_idx.
    scale_attn_weights: bool = True
    scale_by_inverse_layer: bool = False
    word_embed_proj_dim: int | None = None  # OPT-350m: embeddings narrower than the hidden size
    norm_affine: bool = True  # OPT's layer_norm_elementwise_affine
    final_norm: bool = True  # a norm after the last layer (OPT: pre-norm, unless _remove_final_layer_norm)


def learned_config(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` (a config.json of one of ``LEARNED_ARCHS``) in the spellings ``ModelConfig`` reads."""
    arch = raw["architectures"][0]
    if arch == "GPT2LMHeadModel":
        return _gpt2(raw)
    if arch == "OPTForCausalLM":
        return _opt(raw)
    if arch == "NemotronForCausalLM":
        return _nemotron(raw)
    return _olmoe(raw)


def absolute_config(raw: dict[str, Any]) -> AbsoluteConfig | None:
    """GPT-2's and OPT's position and norm options (their configs' own keys); None for other models."""
    arch = (raw.get("architectures") or [""])[0]
    if arch == "GPT2LMHeadModel":
        return AbsoluteConfig(
            position_offset=0,
            pre_norm=True,
            scale_attn_weights=bool(raw.get("scale_attn_weights", True)),
            scale_by_inverse_layer=bool(raw.get("scale_attn_by_inverse_layer_idx", False)),
        )
    if arch == "OPTForCausalLM":
        proj = raw.get("word_embed_proj_dim")
        return AbsoluteConfig(
            position_offset=2,
            pre_norm=bool(raw.get("do_layer_norm_before", True)),
            word_embed_proj_dim=None if proj in (None, raw.get("hidden_size", 768)) else int(proj),
            norm_affine=bool(raw.get("layer_norm_elementwise_affine", True)),
            final_norm=bool(raw.get("do_layer_norm_before", True))
            and not raw.get("_remove_final_layer_norm"),
        )
    return None


def _gpt2(raw: dict[str, Any]) -> dict[str, Any]:
    if raw.get("add_cross_attention"):
        raise ValueError("GPT-2 with add_cross_attention (an encoder-decoder's decoder) is not supported")
    hidden = int(raw.get("n_embd") or raw.get("hidden_size") or 768)
    out = {
        "vocab_size": 50257,
        "eos_token_id": 50256,
        "tie_word_embeddings": True,
        **raw,
        "hidden_size": hidden,
        "num_hidden_layers": int(raw.get("n_layer") or raw.get("num_hidden_layers") or 12),
        "num_attention_heads": int(raw.get("n_head") or raw.get("num_attention_heads") or 12),
        "intermediate_size": int(raw.get("n_inner") or 4 * hidden),
        "max_position_embeddings": int(raw.get("n_positions") or raw.get("max_position_embeddings") or 1024),
        "layer_norm_eps": float(raw.get("layer_norm_epsilon", 1e-5)),
        "hidden_act": raw.get("activation_function") or "gelu_new",
        "attention_bias": True,
    }
    for key in ("num_key_value_heads", "head_dim", "rope_parameters", "rope_scaling", "rope_theta"):
        out.pop(key, None)
    return out


def _opt(raw: dict[str, Any]) -> dict[str, Any]:
    hidden = int(raw.get("hidden_size", 768))
    out = {
        "vocab_size": 50272,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "max_position_embeddings": 2048,
        "eos_token_id": 2,
        "tie_word_embeddings": True,
        **raw,
        "hidden_size": hidden,
        "intermediate_size": int(raw.get("ffn_dim", 3072)),
        "layer_norm_eps": 1e-5,  # OPT's LayerNorms keep nn.LayerNorm's epsilon
        "hidden_act": raw.get("activation_function") or "relu",
        "attention_bias": bool(raw.get("enable_bias", True)),
    }
    for key in ("num_key_value_heads", "head_dim", "rope_parameters", "rope_scaling", "rope_theta"):
        out.pop(key, None)
    return out


def _nemotron(raw: dict[str, Any]) -> dict[str, Any]:
    """NemotronConfig's defaults; its LayerNorm1p epsilon is ``norm_eps``; half of each head rotates
    unless the config says otherwise (transformers 5 keeps the factor in ``rope_parameters``)."""
    rope = raw.get("rope_parameters") or {}
    factor = raw.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 0.5
    return {
        "hidden_act": "relu2",
        "max_position_embeddings": 4096,
        "eos_token_id": 3,
        **raw,
        "layer_norm_eps": float(raw.get("norm_eps", 1e-5)),
        "partial_rotary_factor": float(factor),
    }


def _olmoe(raw: dict[str, Any]) -> dict[str, Any]:
    """OlmoeConfig's defaults; its experts are ``intermediate_size`` wide (read as Qwen3-MoE's
    ``moe_intermediate_size``); ``clip_qkv`` (q, k and v clamped after the norms) is not served."""
    if raw.get("clip_qkv") is not None:
        raise ValueError(f"OLMoE with clip_qkv={raw['clip_qkv']} is not supported (only null)")
    out = {
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "eos_token_id": 50279,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "norm_topk_prob": False,
        **raw,
    }
    out["moe_intermediate_size"] = int(out["intermediate_size"])
    out.setdefault("num_local_experts", out["num_experts"])
    return out
