"""Tiny vision-language checkpoints whose language model ferry serves text-only (Mistral 3, Qwen2-VL,
Qwen2.5-VL, Qwen3-VL and its MoE; engine/models/vision_text.py), for ``engine.demo_build.build_model``.
Each is made with transformers' own config classes, a tiny vision tower included, so the checkpoint
holds the tensors ferry must skip. Imports transformers only when called.
"""

from __future__ import annotations

from typing import Any

# The architectures built here, each with what it exercises.
ARCHS = {
    "mistral3": "Mistral 3 (Mistral Small 3.1/3.2): a Mistral text model with head_dim 32 != hidden / heads, "
    "a one-layer Pixtral vision tower and patch merger",
    "ministral3_vl": "Ministral 3 as released (Mistral3ForConditionalGeneration): a ministral3 text model with "
    "YaRN and Llama 4's query scaling past position 8, a window of 16, a one-layer Pixtral tower",
    "qwen2_vl": "Qwen2-VL: Qwen2 text (q/k/v bias) with M-RoPE sections [2, 3, 3] under rope type mrope",
    "qwen2_5_vl": "Qwen2.5-VL: Qwen2 text with M-RoPE sections [4, 2, 2] and a window of 8 on layer 1",
    "qwen3_vl": "Qwen3-VL: Qwen3 text (per-head q/k norm), interleaved M-RoPE [4, 2, 2], deepstack vision",
    "qwen3_vl_moe": "Qwen3-VL-MoE: Qwen3 text, layer 0 dense, 4 experts (2 per token) stored fused",
}


def arch_config(arch: str, common: dict[str, Any], head_dim: int) -> tuple[Any, type]:
    """(transformers config, model class) of a tiny ``arch`` (one of ``ARCHS``) with ``common``'s sizes
    and special tokens as its text model's."""
    import transformers

    text = dict(common)
    hidden, vocab = text["hidden_size"], text["vocab_size"]
    tokens = {"image_token_id": vocab - 1}
    if arch in ("mistral3", "ministral3_vl"):
        if arch == "mistral3":
            text.update(model_type="mistral", head_dim=2 * head_dim, sliding_window=None)
            text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1_000_000.0}
        else:
            text.update(model_type="ministral3", head_dim=head_dim, sliding_window=16)
            text["rope_parameters"] = {
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
        vision = transformers.PixtralVisionConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            head_dim=8,
            image_size=56,
            patch_size=14,
        )
        cfg = transformers.Mistral3Config(
            text_config=text, vision_config=vision.to_dict(), image_token_index=vocab - 1
        )
        cfg.tie_word_embeddings = common["tie_word_embeddings"]
        return cfg, transformers.Mistral3ForConditionalGeneration
    if arch in ("qwen2_vl", "qwen2_5_vl"):
        v25 = arch == "qwen2_5_vl"
        section = [4, 2, 2] if v25 else [2, 3, 3]
        # Qwen2-VL's released configs name the rope type "mrope" (transformers 5 reads it as default).
        kind = "default" if v25 else "mrope"
        text["rope_parameters"] = {"rope_type": kind, "rope_theta": 10000.0, "mrope_section": section}
        if v25:  # layers from max_window_layers on slide (window 8)
            text.update(use_sliding_window=True, sliding_window=8, max_window_layers=1)
        small = dict(depth=1, num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
        if v25:
            vision = dict(
                **small,
                hidden_size=16,
                intermediate_size=32,
                out_hidden_size=hidden,
                fullatt_block_indexes=[0],
            )
            cfg = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **tokens)
            return cfg, transformers.Qwen2_5_VLForConditionalGeneration
        vision = dict(**small, embed_dim=16, hidden_size=hidden, mlp_ratio=2)
        cfg = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, **tokens)
        return cfg, transformers.Qwen2VLForConditionalGeneration
    if arch in ("qwen3_vl", "qwen3_vl_moe"):
        moe = arch == "qwen3_vl_moe"
        text.update(head_dim=head_dim)
        text["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": 5_000_000.0,
            "mrope_section": [4, 2, 2],
            "mrope_interleaved": True,
        }
        vision = dict(
            depth=2,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            patch_size=16,
            out_hidden_size=hidden,
            num_position_embeddings=16,
            deepstack_visual_indexes=[0],
        )
        if moe:
            # moe_intermediate_size 24: the stored [E, hidden, 2 * 24] and the [E, 2 * 24, hidden]
            # in-memory layouts cannot be mistaken for each other.
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=[0])
            cfg = transformers.Qwen3VLMoeConfig(text_config=text, vision_config=vision, **tokens)
            return cfg, transformers.Qwen3VLMoeForConditionalGeneration
        cfg = transformers.Qwen3VLConfig(text_config=text, vision_config=vision, **tokens)
        return cfg, transformers.Qwen3VLForConditionalGeneration
    raise ValueError(f"unknown tiny architecture {arch!r}")
