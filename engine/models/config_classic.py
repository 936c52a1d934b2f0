"""config.json of the classic LayerNorm families (GPT-NeoX / Pythia, Phi 1-2, StableLM, GPT-J, OLMo 1,
Falcon) in the
spelling ``ModelConfig.from_dict`` reads, with their config classes' defaults filled in as
transformers 5 fills them.

GPT-NeoX names its rope ``rotary_pct`` / ``rotary_emb_base`` (older files) and GPT-J keeps GPT-2's
names (``n_embd``, ``n_head``, ``n_inner``…) and a fixed rope base of 10000; transformers 5 writes
``rope_parameters`` with the rotary share inside. Each class has its own default rotary share.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Raw = dict[str, Any]


def _with_rotary_share(raw: Raw, default: float, legacy: str | None = None) -> Raw:
    """``raw`` with ``partial_rotary_factor`` set where neither it nor ``rope_parameters`` has one:
    from the ``legacy`` key (GPT-NeoX's ``rotary_pct``) or the class's default."""
    rope = raw.get("rope_parameters") or {}
    if raw.get("partial_rotary_factor") is None and rope.get("partial_rotary_factor") is None:
        value = raw.get(legacy) if legacy else None
        raw = {**raw, "partial_rotary_factor": default if value is None else value}
    return raw


def _gpt_neox(raw: Raw) -> Raw:
    out = {
        "use_parallel_residual": True,
        "attention_bias": True,
        "layer_norm_eps": 1e-5,
        "hidden_act": "gelu",
        **raw,
    }
    if "rope_theta" not in out and not (out.get("rope_parameters") or {}).get("rope_theta"):
        out["rope_theta"] = out.get("rotary_emb_base", 10000.0)
    return _with_rotary_share(out, 0.25, "rotary_pct")


def _phi(raw: Raw) -> Raw:
    out = {"layer_norm_eps": 1e-5, "hidden_act": "gelu_new", **raw, "attention_bias": True}  # always biased
    return _with_rotary_share(out, 0.5)


def _stablelm(raw: Raw) -> Raw:
    out = {
        "layer_norm_eps": 1e-5,
        "hidden_act": "silu",
        "use_parallel_residual": False,
        "max_position_embeddings": 4096,
        **raw,
        "attention_bias": bool(raw.get("use_qkv_bias", False)),
    }
    return _with_rotary_share(out, 0.25)


def _gptj(raw: Raw) -> Raw:
    """GPT-2's names as ferry reads them. The rope base is GPT-J's fixed 10000 whatever the file says
    (transformers' GPT-J reads none); ``rotary_dim`` None rotates whole heads."""
    hidden = int(raw.get("n_embd", 4096))
    heads = int(raw.get("n_head", 16))
    rotary = raw.get("rotary_dim", 64)
    named = {k: v for k, v in raw.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
    return {
        **named,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_hidden_layers": int(raw.get("n_layer", 28)),
        "intermediate_size": int(raw.get("n_inner") or 4 * hidden),
        "max_position_embeddings": int(raw.get("n_positions", 2048)),
        "layer_norm_eps": float(raw.get("layer_norm_epsilon", 1e-5)),
        "hidden_act": raw.get("activation_function", "gelu_new"),
        "rope_theta": 10000.0,
        "partial_rotary_factor": 1.0 if rotary is None else int(rotary) / (hidden // heads),
        "vocab_size": int(raw.get("vocab_size", 50400)),
    }


def _olmo(raw: Raw) -> Raw:
    """OLMo 1's LayerNorms run at epsilon 1e-5 whatever the file says (OlmoLayerNorm fixes it)."""
    return {**{k: v for k, v in raw.items() if k != "rms_norm_eps"}, "layer_norm_eps": 1e-5}


def _falcon(raw: Raw) -> Raw:
    """FalconConfig's fields as ferry reads them. K/V heads: ``num_kv_heads`` with the new decoder
    architecture or without multi-query, else one. ALiBi models are refused (see the error)."""
    if raw.get("alibi"):
        raise ValueError(
            "Falcon with alibi=true (Falcon-RW) is not supported: transformers rounds its ALiBi bias "
            "(slope x position) to bfloat16, which ferry's fp32 ALiBi (Bloom's, MPT's) would not reproduce; "
            "rotary Falcon models (alibi=false) are"
        )
    new = bool(raw.get("new_decoder_architecture", False))
    parallel = bool(raw.get("parallel_attn", True))
    if new and not parallel:
        raise ValueError(
            "Falcon with new_decoder_architecture=true and parallel_attn=false is not supported "
            "(transformers' FalconDecoderLayer cannot run it either)"
        )
    hidden = int(raw.get("hidden_size") or raw.get("n_embed") or 4544)
    heads = int(raw.get("num_attention_heads", 71))
    kv = int(raw.get("num_kv_heads") or heads) if new or not raw.get("multi_query", True) else 1
    named = {k: v for k, v in raw.items() if k != "head_dim"}
    return {
        "vocab_size": 65024,
        "num_hidden_layers": 32,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
        "eos_token_id": 11,
        **named,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hidden // heads,
        "intermediate_size": int(raw.get("ffn_hidden_size") or 4 * hidden),
        "layer_norm_eps": float(raw.get("layer_norm_epsilon") or 1e-5),
        "hidden_act": raw.get("activation") or "gelu",
        "attention_bias": bool(raw.get("bias", False)),
        "use_parallel_residual": parallel,
    }


CLASSIC_CONFIGS: dict[str, Callable[[Raw], Raw]] = {
    "OlmoForCausalLM": _olmo,
    "FalconForCausalLM": _falcon,
    "GPTNeoXForCausalLM": _gpt_neox,
    "PhiForCausalLM": _phi,
    "StableLmForCausalLM": _stablelm,
    "GPTJForCausalLM": _gptj,
}
