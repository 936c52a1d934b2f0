"""Tiny configs of the classic LayerNorm families that ``engine.demo_build.build_model`` builds
(GPT-NeoX, Phi, StableLM, GPT-J; engine/models/classic.py), each made with its own transformers
config class so the checkpoint is what transformers writes. Imports transformers only when called.
"""

from __future__ import annotations

from typing import Any

# The architectures built here, each with what it exercises.
ARCHS = {
    "gpt_neox": "GPT-NeoX: parallel residual over two LayerNorms, per-head fused qkv, a quarter rotary",
    "gpt_neox_seq": "GPT-NeoX without parallel residual or attention biases, half rotary, tanh GELU",
    "phi": "Phi: one LayerNorm for parallel attention + MLP, GQA, half rotary, q/k LayerNorm, head bias",
    "stablelm": "StableLM: sequential residual, q/k/v biases, a quarter rotary, GQA, SwiGLU",
    "stablelm_parallel": "StableLM: parallel residual on one LayerNorm, per-head q/k LayerNorm",
    "gptj": "GPT-J: rotary over interleaved pairs of half of each head, parallel blocks, head bias",
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
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "max_position_embeddings",
            "tie_word_embeddings",
        )
    }
    if arch in ("gpt_neox", "gpt_neox_seq"):
        parallel = arch == "gpt_neox"
        cfg = transformers.GPTNeoXConfig(
            **tokens,
            **sizes,
            use_parallel_residual=parallel,
            attention_bias=parallel,
            hidden_act="gelu" if parallel else "gelu_new",
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            rotary_pct=0.25 if parallel else 0.5,
        )
        return cfg, transformers.GPTNeoXForCausalLM
    if arch == "phi":
        cfg = transformers.PhiConfig(
            **tokens,
            **sizes,
            num_key_value_heads=common["num_key_value_heads"],
            partial_rotary_factor=0.5,
            qk_layernorm=True,
        )
        return cfg, transformers.PhiForCausalLM
    if arch in ("stablelm", "stablelm_parallel"):
        parallel = arch == "stablelm_parallel"
        cfg = transformers.StableLmConfig(
            **tokens,
            **sizes,
            num_key_value_heads=common["num_key_value_heads"],
            partial_rotary_factor=0.25,
            use_qkv_bias=not parallel,
            qk_layernorm=parallel,
            use_parallel_residual=parallel,
        )
        return cfg, transformers.StableLmForCausalLM
    if arch == "gptj":
        cfg = transformers.GPTJConfig(
            **tokens,
            n_embd=sizes["hidden_size"],
            n_inner=sizes["intermediate_size"],
            n_layer=sizes["num_hidden_layers"],
            n_head=sizes["num_attention_heads"],
            n_positions=sizes["max_position_embeddings"],
            tie_word_embeddings=sizes["tie_word_embeddings"],
            rotary_dim=head_dim // 2,
        )
        return cfg, transformers.GPTJForCausalLM
    raise ValueError(f"unknown tiny architecture {arch!r}")
