"""Configs that transformers completes with its own class defaults, completed the same way before
they are read: Gemma 3's text model (also inside a multimodal checkpoint), LLaVA's language model and
image side, Gemma 2 and gpt-oss. Their checkpoints' config.json leave out what equals the default.
"""

from __future__ import annotations

from typing import Any

from engine.models.config_parts import VisionConfig

# Gemma3TextConfig's defaults: the multimodal checkpoints' text_config leaves most of them out.
_GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "model_type": "gemma3_text",
    "vocab_size": 262208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-6,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "max_position_embeddings": 131072,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "tie_word_embeddings": True,
    "eos_token_id": 1,
}


def _gemma3_text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The text model's config with Gemma3TextConfig's defaults filled in; for a multimodal
    checkpoint (Gemma3ForConditionalGeneration) its ``text_config``, served text-only."""
    text = raw.get("text_config") or raw
    top = {
        k: raw[k]
        for k in ("architectures", "eos_token_id", "dtype", "torch_dtype", "quantization_config")
        if k in raw
    }
    merged = {**_GEMMA3_TEXT_DEFAULTS, **text, **top}
    merged["model_type"] = "gemma3_text"
    if "text_config" in raw:
        merged["final_logit_softcapping"] = None  # transformers' multimodal Gemma 3 never applies it
    return merged


# LlamaConfig's defaults (LLaVA's default text model), for text_configs that leave them out.
_LLAMA_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
}


def _llava_config(raw: dict[str, Any]) -> tuple[dict[str, Any], VisionConfig]:
    """A LLaVA checkpoint's language model config (its ``text_config``, LlavaConfig's Llama default
    when absent) and its image side, with LlavaConfig's defaults."""
    text = dict(raw.get("text_config") or {})
    text.setdefault("model_type", "llama")
    if text["model_type"] == "llama":  # the hub's llava-1.5 configs write only what differs from these
        text = {**_LLAMA_DEFAULTS, **text}
    top = {k: raw[k] for k in ("architectures", "dtype", "torch_dtype", "quantization_config") if k in raw}
    layer = raw.get("vision_feature_layer", -2)
    vision = VisionConfig(
        vision_config=dict(raw.get("vision_config") or {"model_type": "clip_vision_model"}),
        feature_layer=tuple(int(x) for x in layer) if isinstance(layer, list) else int(layer),
        select_strategy=str(raw.get("vision_feature_select_strategy", "default")),
        projector_act=str(raw.get("projector_hidden_act", "gelu")),
        projector_bias=bool(raw.get("multimodal_projector_bias", True)),
        image_token_id=int(raw.get("image_token_id", raw.get("image_token_index", 32000))),
    )
    if vision.select_strategy not in ("default", "full"):
        raise ValueError(f"vision_feature_select_strategy {vision.select_strategy!r} is not supported")
    return {**text, **top}, vision


# Gemma2Config's defaults (layer i slides when i is even).
_GEMMA2_DEFAULTS: dict[str, Any] = {
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 2,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "tie_word_embeddings": True,
}


# GptOssConfig's defaults (layer i slides when i is even; YaRN stretches 4096 positions 32 times).
_GPT_OSS_DEFAULTS: dict[str, Any] = {
    "head_dim": 64,
    "sliding_window": 128,
    "sliding_window_pattern": 2,
    "attention_bias": True,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "num_local_experts": 128,
    "num_experts_per_tok": 4,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
    # Under the transformers 5 name, so a config's own rope_scaling / rope_theta (the released
    # checkpoints' spelling) or rope_parameters wins.
    "rope_parameters": {
        "rope_theta": 150000.0,
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
}


def _rope_default(theta: float) -> dict[str, Any]:
    # Under the transformers 5 name, so a config's own rope_theta / rope_scaling (or rope_parameters) wins.
    return {"rope_parameters": {"rope_type": "default", "rope_theta": theta}}


# Class defaults of configs read through the Llama / OLMo models, where they differ from what ferry
# assumes, for config.json files that leave them out (transformers fills them from its config class).
ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "SeedOssForCausalLM": {"attention_bias": True, "head_dim": 128, "max_position_embeddings": 524288},
    # OLMo 3: every fourth layer full attention, the others sliding.
    "Olmo3ForCausalLM": {
        "sliding_window": 4096,
        "sliding_window_pattern": 4,
        "rms_norm_eps": 1e-5,
        **_rope_default(500000.0),
    },
    "SmolLM3ForCausalLM": {
        "tie_word_embeddings": True,
        "max_position_embeddings": 32768,
        **_rope_default(2_000_000.0),
    },
    "Glm4ForCausalLM": {
        "attention_bias": True,
        "head_dim": 128,
        "rms_norm_eps": 0.00000015625,
        "max_position_embeddings": 131072,
    },
    "Ernie4_5ForCausalLM": {
        "head_dim": 128,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        **_rope_default(500000.0),
    },
}
ARCH_DEFAULTS["GemmaForCausalLM"] = {
    "head_dim": 256,
    "tie_word_embeddings": True,
    "max_position_embeddings": 8192,
}
# EXAONE 4: every fourth layer full attention (without rotary), the others sliding.
ARCH_DEFAULTS["Exaone4ForCausalLM"] = {
    "sliding_window": 4096,
    "sliding_window_pattern": 4,
    "rms_norm_eps": 1e-5,
}
ARCH_DEFAULTS["HunYuanDenseV1ForCausalLM"] = {"rms_norm_eps": 1e-5}
ARCH_DEFAULTS["MiniMaxM2ForCausalLM"] = {
    "head_dim": 128,
    "max_position_embeddings": 196608,
    "num_local_experts": 256,
    "num_experts_per_tok": 8,
    **_rope_default(5_000_000.0),
}
# GraniteConfig scores attention by attention_multiplier, 1.0 when left out (not head_dim ** -0.5).
ARCH_DEFAULTS["GraniteForCausalLM"] = {"attention_multiplier": 1.0}
ARCH_DEFAULTS["GraniteMoeForCausalLM"] = {
    "attention_multiplier": 1.0,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
}
ARCH_DEFAULTS["Ernie4_5_MoeForCausalLM"] = {  # as the dense model's, but head_dim hidden / heads
    **{k: v for k, v in ARCH_DEFAULTS["Ernie4_5ForCausalLM"].items() if k != "head_dim"},
    "moe_intermediate_size": 1536,
    "moe_k": 6,
    "moe_num_experts": 64,
    "moe_num_shared_experts": 2,
    "moe_layer_start_index": 1,
    "moe_layer_end_index": -1,
    "moe_layer_interval": 1,
}
# Arcee (AFM): Llama with a ReLU^2 MLP.
ARCH_DEFAULTS["ArceeForCausalLM"] = {
    "hidden_act": "relu2",
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
}
# StarCoder2: biases on every projection, LayerNorms (norm_epsilon), tied embeddings, 2 KV heads.
ARCH_DEFAULTS["Starcoder2ForCausalLM"] = {
    "hidden_act": "gelu_pytorch_tanh",
    "norm_epsilon": 1e-5,
    "use_bias": True,
    "tie_word_embeddings": True,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}
# Command R: LayerNorms (layer_norm_eps), tied embeddings, logits times logit_scale.
ARCH_DEFAULTS["CohereForCausalLM"] = {
    "logit_scale": 0.0625,
    "layer_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "max_position_embeddings": 8192,
    **_rope_default(500000.0),
}
# Command R7B / A: every fourth layer full attention (without rotary), the others sliding; rope theta
# 10000 (Cohere2Config has no default_theta of its own).
ARCH_DEFAULTS["Cohere2ForCausalLM"] = {
    **{k: v for k, v in ARCH_DEFAULTS["CohereForCausalLM"].items() if k != "rope_parameters"},
    "sliding_window": 4096,
    "sliding_window_pattern": 4,
}
# Apertus: xIELU MLP; without rope_parameters, ApertusConfig's llama3-scaled rope.
ARCH_DEFAULTS["ApertusForCausalLM"] = {
    "hidden_act": "xielu",
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 65536,
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 12000000.0,
        "factor": 8.0,
        "original_max_position_embeddings": 8192,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
    },
}
# dots.llm1: Qwen3 attention + DeepSeek-V3's router (top-k weights not renormalised by default);
# layers from max_window_layers on slide when a window is set.
ARCH_DEFAULTS["Dots1ForCausalLM"] = {
    "num_key_value_heads": 32,
    "norm_topk_prob": False,
    "sliding_window": 4096,
    "max_window_layers": 62,
}
# GLM-4-9B-chat-hf (GlmConfig): GLM-4-0414's defaults, without its sandwich norms.
ARCH_DEFAULTS["GlmForCausalLM"] = dict(ARCH_DEFAULTS["Glm4ForCausalLM"], num_key_value_heads=2)
# Helium: heads of 128 whatever hidden / heads is, KV heads 20 (HeliumConfig's numbers), base 100000.
ARCH_DEFAULTS["HeliumForCausalLM"] = {
    "head_dim": 128,
    "num_key_value_heads": 20,
    "rms_norm_eps": 1e-8,
    "max_position_embeddings": 4096,
    **_rope_default(100000.0),
}
# Ministral: 8 KV heads when left out (MinistralConfig's field default, not the head count).
ARCH_DEFAULTS["MinistralForCausalLM"] = {"num_key_value_heads": 8, "max_position_embeddings": 131072}
# Ministral 3: without rope_parameters, Ministral3Config's YaRN with Llama 4's attention temperature.
ARCH_DEFAULTS["Ministral3ForCausalLM"] = {
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 262144,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 1000000.0,
        "factor": 16.0,
        "original_max_position_embeddings": 16384,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale_all_dim": 1.0,
        "mscale": 1.0,
        "llama_4_scaling_beta": 0.1,
    },
}
