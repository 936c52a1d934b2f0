"""Tiny configs of the ALiBi families, Bloom and MPT, that ``engine.demo_build.build_model`` builds,
each with its own transformers config class (so the checkpoint is what transformers writes). Six heads
where the slopes' rules differ from plain powers of two. Imports transformers only when called.
"""

from __future__ import annotations

from typing import Any

ARCHS = {
    "bloom": "Bloom: ALiBi over 6 heads (Bloom's extra slopes), embedding LayerNorm, per-head fused qkv",
    "bloom_post": "Bloom with apply_residual_connection_post_layernorm (residuals from the normed input)",
    "mpt": "MPT: ALiBi over 6 heads (MPT's interleaved slopes), no biases, clip_qkv 0.5, softmax_scale",
}


def arch_config(arch: str, common: dict[str, Any], head_dim: int) -> tuple[Any, type]:
    """(transformers config, model class) of a tiny ``arch`` (one of ``ARCHS``) with ``common``'s
    vocabulary and special tokens; the hidden size is ``head_dim`` times the heads."""
    import transformers

    tokens = {k: common[k] for k in ("vocab_size", "eos_token_id", "bos_token_id", "pad_token_id")}
    layers = common["num_hidden_layers"]
    if arch in ("bloom", "bloom_post"):
        heads = 6 if arch == "bloom" else 4
        cfg = transformers.BloomConfig(
            **tokens,
            hidden_size=heads * head_dim,
            n_layer=layers,
            n_head=heads,
            apply_residual_connection_post_layernorm=arch == "bloom_post",
            # Untied: tied to embeddings this large (std 0.5) the head would only echo the last token
            # (MPT's tiny model keeps the tie, Bloom's default).
            tie_word_embeddings=False,
        )
        return cfg, transformers.BloomForCausalLM
    if arch == "mpt":
        cfg = transformers.MptConfig(
            **tokens,
            d_model=6 * head_dim,
            n_heads=6,
            n_layers=layers,
            max_seq_len=256,
            attn_config={"clip_qkv": 0.5, "softmax_scale": 0.3},
        )
        return cfg, transformers.MptForCausalLM
    raise ValueError(f"unknown tiny architecture {arch!r}")
