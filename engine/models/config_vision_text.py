"""config.json of the vision-language checkpoints whose language model ferry serves text-only
(Mistral 3, Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE; engine/models/vision_text.py): the text
model's settings, as ``ModelConfig.from_dict`` reads a plain causal LM's.

The text model's settings sit in ``text_config`` (transformers 5's spelling, and Qwen3-VL's and Mistral
3's from the start); Qwen2-VL and Qwen2.5-VL checkpoints written by transformers 4 keep them at the top
level beside ``vision_config``. What a text config leaves out is its transformers class's default.

M-RoPE: the Qwen VL models rotate each head in sections, each section by one of three position ids
(time, height, width; ``mrope_section`` sizes them, Qwen3-VL interleaves them). A text token's three
ids are all its position, so every section turns by the same position: ordinary rotary over the whole
head, which is what ferry runs (an image's tokens, the only ones whose ids differ, are refused with a
400). The ``mrope`` rope type therefore reads as ``default`` (transformers 5 does the same), and any
other type (YaRN…) applies to the whole head as it does to each section.
"""

from __future__ import annotations

from typing import Any

from engine.models.config_arch import ARCH_DEFAULTS

Raw = dict[str, Any]

# MistralConfig's defaults, for a Mistral 3 text_config that leaves them out.
_MISTRAL: Raw = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
}
# Mistral3Config's text model when config.json has no text_config at all (Mistral Small 3.1's shape).
_MISTRAL_SMALL: Raw = {
    "vocab_size": 131072,
    "hidden_size": 5120,
    "intermediate_size": 32768,
    "num_hidden_layers": 40,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1_000_000_000.0,
    "sliding_window": None,
}
# Qwen2VLTextConfig's and Qwen2_5_VLTextConfig's defaults (head_dim is always hidden / heads there).
_QWEN2_VL: Raw = {
    "vocab_size": 152064,
    "hidden_size": 8192,
    "intermediate_size": 29568,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1_000_000.0,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 80,
}
# Qwen3VLTextConfig's defaults.
_QWEN3_VL: Raw = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 128,
    "max_position_embeddings": 128000,
    "rms_norm_eps": 1e-6,
    "rope_theta": 500000.0,
}
# Qwen3VLMoeTextConfig's defaults (head_dim: hidden / heads when left out).
_QWEN3_VL_MOE: Raw = {
    **{k: v for k, v in _QWEN3_VL.items() if k != "head_dim"},
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "moe_intermediate_size": 1408,
    "num_experts_per_tok": 4,
    "num_experts": 60,
    "decoder_sparse_step": 1,
}

# Ministral3Config's defaults (Ministral3ForCausalLM's too).
MINISTRAL3_DEFAULTS: Raw = ARCH_DEFAULTS["Ministral3ForCausalLM"]

# Architecture -> (the model_type ferry reads its text model as, that text config class's defaults).
VISION_TEXT: dict[str, tuple[str, Raw]] = {
    "Mistral3ForConditionalGeneration": ("mistral", _MISTRAL),
    "Qwen2VLForConditionalGeneration": ("qwen2", _QWEN2_VL),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2", _QWEN2_VL),
    "Qwen3VLForConditionalGeneration": ("qwen3", _QWEN3_VL),
    "Qwen3VLMoeForConditionalGeneration": ("qwen3_moe", _QWEN3_VL_MOE),
}

# Top-level keys that hold for the whole checkpoint, the text model included.
_TOP = ("architectures", "dtype", "torch_dtype", "quantization_config", "eos_token_id")


def vision_text_config(raw: Raw) -> Raw:
    """The language model's config of a checkpoint of one of ``VISION_TEXT``'s architectures."""
    arch = raw["architectures"][0]
    model_type, defaults = VISION_TEXT[arch]
    text = raw.get("text_config")
    if text is None and arch.startswith("Qwen2"):  # transformers 4's flat Qwen2-VL / Qwen2.5-VL
        text = {k: v for k, v in raw.items() if k not in ("vision_config", "model_type")}
    elif text is None and arch.startswith("Mistral3"):
        defaults, text = _MISTRAL_SMALL, {}
    elif text is None:
        raise ValueError(f"{arch}: config.json has no text_config")
    kind = text.get("model_type", "mistral" if arch.startswith("Mistral3") else None)
    if arch.startswith("Mistral3") and kind == "ministral3":
        # Ministral 3's releases: its text model (YaRN, Llama 4's position-scaled queries), read with
        # Ministral3Config's defaults as Ministral3ForCausalLM's config is.
        model_type, defaults = "ministral3", {**MINISTRAL3_DEFAULTS, "rope_theta": 1_000_000.0}
        text = {"rope_parameters": MINISTRAL3_DEFAULTS["rope_parameters"], **text}
    elif arch.startswith("Mistral3") and kind != "mistral":
        raise ValueError(
            f"{arch}: text_config.model_type {kind!r} is not supported (ferry serves Mistral 3's "
            "'mistral' text model, as in Mistral Small 3.1 / 3.2, and 'ministral3', Ministral 3's)"
        )
    merged = {**defaults, **text, **{k: raw[k] for k in _TOP if k in raw}}
    merged["model_type"] = model_type
    merged.pop("rope_scaling", None)
    merged["rope_parameters"] = _text_rope(arch, text, merged, defaults["rope_theta"])
    merged["rope_theta"] = merged["rope_parameters"]["rope_theta"]
    if arch.startswith("Qwen2"):
        merged.pop("head_dim", None)  # Qwen2-VL's attention always splits hidden_size into the heads
    if arch.startswith("Qwen3VL"):
        merged["use_sliding_window"] = False  # Qwen3-VL's attention has no window
    if arch == "Qwen3VLMoeForConditionalGeneration":
        merged["norm_topk_prob"] = True  # its router always renormalises the top-k weights
    # The head is the checkpoint's lm_head when it holds one, else the embeddings: what transformers 5
    # loads either way (it ties only a head that is absent or equal), whereas the configs' flags
    # disagree (Mistral3Config's top-level default is True, Mistral Small ships a separate head).
    merged["tie_word_embeddings"] = False
    return merged


def _text_rope(arch: str, text: Raw, merged: Raw, default_theta: float) -> Raw:
    """The text model's rope as ``rope_parameters`` with M-RoPE's keys read and dropped (see the
    module docstring); a Qwen2-VL ``mrope_section`` must cover half a head, as its rotary needs."""
    rope = dict(text.get("rope_scaling") or text.get("rope_parameters") or {})
    theta = text.get("rope_theta") or rope.pop("rope_theta", None) or default_theta
    kind = rope.pop("rope_type", None) or rope.get("type") or "default"
    rope.pop("type", None)
    section = rope.pop("mrope_section", None)
    rope.pop("mrope_interleaved", None)
    if arch.startswith("Qwen2"):
        section = section or [16, 24, 24]  # Qwen2VLRotaryEmbedding's default
        head_dim = int(merged["hidden_size"]) // int(merged["num_attention_heads"])
        if sum(int(s) for s in section) != head_dim // 2:
            raise ValueError(
                f"{arch}: rope mrope_section {section} does not add up to half the head dim ({head_dim // 2})"
            )
    return {**rope, "rope_type": "default" if kind == "mrope" else kind, "rope_theta": float(theta)}
