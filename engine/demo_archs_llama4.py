"""Tiny Llama 4 configs that ``engine.demo_build.build_model`` builds, each made with transformers'
own config class so the checkpoint is what transformers writes. Imports transformers only when called.
"""

from __future__ import annotations

from typing import Any

# The architectures built here, each with what it exercises.
ARCHS = {
    "llama4": "Llama 4 text: 4 layers, chunks of 8 on the rope layers (0-2), a NoPE full layer (3) with "
    "temperature tuning (floor_scale 4), qk norm, MoE (4 experts, top 1, a shared one) on layers 1 and 3",
    "llama4_top2": "llama4 with 2 experts per token",
    "llama4_mm": "llama4's text model in a Llama4ForConditionalGeneration checkpoint (tiny vision tower)",
    "phimoe": "Phi-3.5-MoE: LayerNorms, q/k/v/o and head biases, longrope, 4 experts behind sparsemixer "
    "(router_jitter_noise 0.2, so its softmaxes see several experts), a window of 24",
}


def arch_config(arch: str, common: dict[str, Any], head_dim: int) -> tuple[Any, type]:
    """(transformers config, model class) of a tiny ``arch`` (one of ``ARCHS``) with ``common``'s
    sizes and special tokens."""
    import transformers

    if arch == "phimoe":
        half = head_dim // 2
        rope = {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [2.0 + 0.2 * i for i in range(half)],
            "short_mscale": 1.2,
            "long_mscale": 1.2,
            "original_max_position_embeddings": 64,
        }
        cfg = transformers.PhimoeConfig(
            **common,
            num_local_experts=4,
            num_experts_per_tok=2,
            router_jitter_noise=0.2,
            attention_bias=True,
            lm_head_bias=True,
            sliding_window=24,
            rope_parameters=rope,
        )
        return cfg, transformers.PhimoeForCausalLM
    text = transformers.Llama4TextConfig(
        **{**common, "num_hidden_layers": 4},
        head_dim=head_dim,
        intermediate_size_mlp=2 * common["intermediate_size"],
        num_local_experts=4,
        num_experts_per_tok=2 if arch == "llama4_top2" else 1,
        interleave_moe_layer_step=2,
        attention_chunk_size=8,
        floor_scale=4,  # the NoPE layer's query scale grows from position 3 on (8192 would hide it)
        attn_scale=0.1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    if arch != "llama4_mm":
        return text, transformers.Llama4ForCausalLM
    vision = transformers.Llama4VisionConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        vision_output_dim=32,
        image_size=28,
        patch_size=14,
        projector_input_dim=32,
        projector_output_dim=common["hidden_size"],
    )
    cfg = transformers.Llama4Config(text_config=text.to_dict(), vision_config=vision.to_dict())
    return cfg, transformers.Llama4ForConditionalGeneration
