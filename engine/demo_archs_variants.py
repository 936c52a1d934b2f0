"""Tiny configs of small variants of families ferry already serves, that ``engine.demo_build.build_model``
builds: OLMo 1 and Falcon (engine/models/classic.py, falcon.py), GLM-4-9B, Helium, Ministral and
Ministral 3 (engine/models/llama.py), each made with its own transformers config class so the
checkpoint is what transformers writes. Imports transformers only when called.
"""

from __future__ import annotations

from typing import Any

# The architectures built here, each with what it exercises.
ARCHS = {
    "olmo": "OLMo 1: LayerNorms without weights, q/k/v/o biases, clip_qkv clamping, GQA",
    "glm": "GLM-4-9B: half of each head rotated in interleaved pairs, q/k/v biases, fused gate_up, GQA",
    "helium": "Helium: whole heads rotated in interleaved pairs, q/k/v biases, GQA",
    "ministral": "Ministral: a sliding (window 8) and a full layer by layer_types",
    "ministral3": "Ministral 3: YaRN and Llama 4's query scaling past position 8, window 16 on each layer",
    "falcon": "Falcon 40B-style: grouped q/k/v of 2 K/V heads, ln_attn + ln_mlp, biases everywhere",
    "falcon_mq": "Falcon 7B-style: multi-query, one LayerNorm for parallel attention + MLP, no biases",
    "falcon_seq": "Falcon without multi-query or parallel_attn: per-head q/k/v, sequential, biases",
    "falcon_one_norm": "Falcon 2-style: grouped q/k/v, new architecture with one LayerNorm per layer",
}


def arch_config(arch: str, common: dict[str, Any], head_dim: int) -> tuple[Any, type]:
    """(transformers config, model class) of a tiny ``arch`` (one of ``ARCHS``) with ``common``'s
    sizes and special tokens."""
    import transformers

    tokens = {k: common[k] for k in ("vocab_size", "eos_token_id", "bos_token_id", "pad_token_id")}
    sizes = {
        k: common[k]
        for k in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "max_position_embeddings",
            "tie_word_embeddings",
        )
    }
    kv, inter = common["num_key_value_heads"], common["intermediate_size"]
    llama_like = {**tokens, **sizes, "intermediate_size": inter, "num_key_value_heads": kv}
    if arch == "olmo":
        cfg = transformers.OlmoConfig(**llama_like, attention_bias=True, clip_qkv=0.8)
        return cfg, transformers.OlmoForCausalLM
    if arch == "glm":
        cfg = transformers.GlmConfig(**llama_like, head_dim=head_dim, rms_norm_eps=1e-6)
        return cfg, transformers.GlmForCausalLM
    if arch == "helium":
        cfg = transformers.HeliumConfig(**llama_like, head_dim=head_dim, attention_bias=True)
        return cfg, transformers.HeliumForCausalLM
    if arch == "ministral":
        types = ["sliding_attention", "full_attention"] * (sizes["num_hidden_layers"] // 2)
        cfg = transformers.MinistralConfig(
            **llama_like, head_dim=head_dim, sliding_window=8, layer_types=types
        )
        return cfg, transformers.MinistralForCausalLM
    if arch == "ministral3":
        rope = {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 8,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": 0.5,
        }
        cfg = transformers.Ministral3Config(
            **llama_like, head_dim=head_dim, sliding_window=16, rope_parameters=rope
        )
        return cfg, transformers.Ministral3ForCausalLM
    if arch.startswith("falcon"):
        shape = {
            "falcon": {"new_decoder_architecture": True, "num_kv_heads": kv, "bias": True},
            "falcon_mq": {"multi_query": True, "parallel_attn": True, "bias": False},
            "falcon_seq": {"multi_query": False, "parallel_attn": False, "bias": True},
            "falcon_one_norm": {
                "new_decoder_architecture": True,
                "num_kv_heads": kv,
                "num_ln_in_parallel_attn": 1,
            },
        }[arch]
        cfg = transformers.FalconConfig(**tokens, **sizes, ffn_hidden_size=inter, **shape)
        return cfg, transformers.FalconForCausalLM
    raise ValueError(f"unknown tiny architecture {arch!r}")
