"""Tiny configs of more architectures that ``engine.demo_build.build_model`` builds (Llama-family,
OLMo, Gemma 1, StarCoder2 and Cohere variants): each made with its own transformers config class, so
the checkpoint is what transformers writes. Imports transformers only when called.
"""

from __future__ import annotations

from typing import Any

# The architectures built here, each with what it exercises.
ARCHS = {
    "seed_oss": "Seed-OSS: Llama with q/k/v biases",
    "olmo3": "OLMo 3: OLMo 2 with a sliding (window 8) and a full layer, each layer type its own rope",
    "smollm3": "SmolLM3: Llama whose second layer has no rotary (NoPE)",
    "glm4": "GLM-4-0414: sandwich norms, fused gate_up, q/k/v bias, half of each head rotated in pairs",
    "ernie4_5": "ERNIE 4.5: Llama with rope over interleaved pairs",
    "ernie4_5_moe": "ERNIE 4.5 MoE: 8 experts, 2 per token (softmax + correction bias), 1 shared",
    "granitemoe": "Granite-MoE: Granite's four multipliers, 4 experts (2 per token) stored fused",
    "gemma": "Gemma 1: scaled embeddings, 1 + weight norms, GeGLU",
    "exaone4": "EXAONE 4: post-block norms, per-head q/k norm; a sliding (window 8) layer, a full NoPE one",
    "hunyuan_dense": "Hunyuan dense: per-head q/k norm after rotary, NTK-alpha rope",
    "arcee": "Arcee (AFM): Llama with an ungated ReLU^2 MLP (up_proj, down_proj)",
    "starcoder2": "StarCoder2: LayerNorms and projections with biases, a GELU MLP, a window of 8",
    "cohere": "Command R: parallel attention + MLP on one LayerNorm, per-head q/k LayerNorm, logit_scale",
    "cohere2": "Command R7B: Command R with a sliding (window 8) layer and a full one without rotary",
    "apertus": "Apertus: an ungated xIELU MLP, per-head q/k RMSNorm",
    "dots1": "dots.llm1: q/k norm, V3 router (sigmoid + bias, groups, unnormalised), 1 shared; a window",
    "minimax_m2": "MiniMax-M2: q/k norm over all heads, half-rotary, 4 experts, 2 per token (sigmoid + bias)",
}


def arch_config(arch: str, common: dict[str, Any], head_dim: int) -> tuple[Any, type]:
    """(transformers config, model class) of a tiny ``arch`` (one of ``ARCHS``) with ``common``'s
    sizes and special tokens."""
    import transformers

    if arch == "seed_oss":
        cfg = transformers.SeedOssConfig(**common, head_dim=head_dim, attention_bias=True)
        return cfg, transformers.SeedOssForCausalLM
    if arch == "olmo3":
        layers = common["num_hidden_layers"]
        cfg = transformers.Olmo3Config(
            **common,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * (layers // 2),
        )
        # Linear scaling on the full layers only, so a rope applied to the wrong layer type shows.
        cfg.rope_parameters = {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        }
        return cfg, transformers.Olmo3ForCausalLM
    if arch == "smollm3":
        layers = common["num_hidden_layers"]
        cfg = transformers.SmolLM3Config(**common, no_rope_layers=[1, 0] * (layers // 2))
        return cfg, transformers.SmolLM3ForCausalLM
    if arch == "glm4":
        cfg = transformers.Glm4Config(**common, head_dim=head_dim, attention_bias=True)
        return cfg, transformers.Glm4ForCausalLM
    if arch == "ernie4_5":
        return transformers.Ernie4_5Config(**common, head_dim=head_dim), transformers.Ernie4_5ForCausalLM
    if arch == "ernie4_5_moe":
        moe = dict(moe_num_experts=8, moe_k=2, moe_num_shared_experts=1, moe_layer_start_index=1)
        cfg = transformers.Ernie4_5_MoeConfig(
            **common, head_dim=head_dim, moe_intermediate_size=common["intermediate_size"] // 4, **moe
        )
        return cfg, transformers.Ernie4_5_MoeForCausalLM
    if arch == "granitemoe":
        scalings = dict(
            embedding_multiplier=2.0, attention_multiplier=0.1, residual_multiplier=0.5, logits_scaling=1.5
        )
        moe = dict(num_local_experts=4, num_experts_per_tok=2)
        return transformers.GraniteMoeConfig(**common, **scalings, **moe), transformers.GraniteMoeForCausalLM
    if arch == "gemma":
        return transformers.GemmaConfig(**common, head_dim=head_dim), transformers.GemmaForCausalLM
    if arch == "exaone4":
        layers = common["num_hidden_layers"]
        cfg = transformers.Exaone4Config(
            **common,
            head_dim=head_dim,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * (layers // 2),
        )
        return cfg, transformers.Exaone4ForCausalLM
    if arch == "hunyuan_dense":
        cfg = transformers.HunYuanDenseV1Config(**common, head_dim=head_dim)
        # The released checkpoints' rope: "dynamic" with a fixed alpha stretches the base once.
        cfg.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 50.0, "factor": 1.0}
        return cfg, transformers.HunYuanDenseV1ForCausalLM
    if arch == "minimax_m2":  # rotary_dim: the released checkpoints' spelling of partial rotary
        moe = dict(num_local_experts=4, num_experts_per_tok=2)
        cfg = transformers.MiniMaxM2Config(**common, head_dim=head_dim, rotary_dim=head_dim // 2, **moe)
        return cfg, transformers.MiniMaxM2ForCausalLM
    if arch == "arcee":
        return transformers.ArceeConfig(**common), transformers.ArceeForCausalLM
    if arch == "starcoder2":  # norm_epsilon: its name for the LayerNorms' epsilon
        sizes = {k: v for k, v in common.items() if k != "rms_norm_eps"}
        cfg = transformers.Starcoder2Config(**sizes, norm_epsilon=1e-5, sliding_window=8)
        return cfg, transformers.Starcoder2ForCausalLM
    if arch in ("cohere", "cohere2"):  # layer_norm_eps: their name for the LayerNorms' epsilon
        sizes = {k: v for k, v in common.items() if k != "rms_norm_eps"}
        if arch == "cohere":
            cfg = transformers.CohereConfig(**sizes, layer_norm_eps=1e-5, logit_scale=0.5, use_qk_norm=True)
            return cfg, transformers.CohereForCausalLM
        layers = common["num_hidden_layers"]
        types = ["sliding_attention", "full_attention"] * (layers // 2)
        cfg = transformers.Cohere2Config(
            **sizes, layer_norm_eps=1e-5, logit_scale=0.5, sliding_window=8, layer_types=types
        )
        return cfg, transformers.Cohere2ForCausalLM
    if arch == "apertus":  # plain rope (ApertusConfig's default is llama3-scaled)
        cfg = transformers.ApertusConfig(
            **common, rope_parameters={"rope_type": "default", "rope_theta": 1e4}
        )
        return cfg, transformers.ApertusForCausalLM
    if arch == "dots1":  # layer 0 dense; 8 experts in 2 groups, 2 per token; the last layer slides
        layers = common["num_hidden_layers"]
        moe = dict(n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1)
        cfg = transformers.Dots1Config(
            **common,
            head_dim=head_dim,
            moe_intermediate_size=common["intermediate_size"] // 4,
            first_k_dense_replace=1,
            routed_scaling_factor=2.0,
            sliding_window=8,
            max_window_layers=layers - 1,
            **moe,
        )
        return cfg, transformers.Dots1ForCausalLM
    raise ValueError(f"unknown tiny architecture {arch!r}")
