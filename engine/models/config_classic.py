"""config.json of the classic LayerNorm families (GPT-NeoX / Pythia, Phi 1-2, StableLM, GPT-J) in the
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


CLASSIC_CONFIGS: dict[str, Callable[[Raw], Raw]] = {
    "GPTNeoXForCausalLM": _gpt_neox,
    "PhiForCausalLM": _phi,
    "StableLmForCausalLM": _stablelm,
    "GPTJForCausalLM": _gptj,
}
