"""Tiny configs of GPT-2, OPT (pre- and post-norm), OLMoE and Nemotron that
``engine.demo_build.build_model`` builds, each with its own transformers config class (so the
checkpoint is what transformers writes). Imports transformers only when called.
"""

from __future__ import annotations

from typing import Any

ARCHS = {
    "gpt2": "GPT-2: learned positions (64), Conv1D weights, gelu_new, attention scaled by 1/(layer+1)",
    "opt": "OPT: learned positions offset by 2, pre-norm, ReLU MLP, biases, an untied head",
    "opt_post": "OPT-350m's shape: post-norm, no final norm, word_embed_proj_dim 32 (project_in/out), tied",
    "olmoe": "OLMoE: q/k RMSNorm over whole projections, 4 experts, 2 per token (softmax, unnormalised)",
    "nemotron": "Nemotron: LayerNorm1p, rotary on a half of each head, ReLU^2 MLP with biases, untied",
}

# Names of each tiny model's norm weights, set away from their init (ones or zeros) by build_model.
NORMS = ("ln_", "layer_norm", "layernorm", "q_norm", "k_norm", ".norm.")


def arch_config(arch: str, common: dict[str, Any], head_dim: int) -> tuple[Any, type]:
    """(transformers config, model class) of a tiny ``arch`` (one of ``ARCHS``) with ``common``'s
    sizes and special tokens."""
    import transformers

    sizes = {k: v for k, v in common.items() if k not in ("rms_norm_eps", "num_key_value_heads")}
    if arch == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=common["vocab_size"],
            n_embd=common["hidden_size"],
            n_layer=common["num_hidden_layers"],
            n_head=common["num_attention_heads"],
            n_inner=common["intermediate_size"],
            n_positions=256,
            scale_attn_by_inverse_layer_idx=True,
            tie_word_embeddings=True,
            **{k: common[k] for k in ("eos_token_id", "bos_token_id", "pad_token_id")},
        )
        return cfg, transformers.GPT2LMHeadModel
    if arch in ("opt", "opt_post"):
        opt = {k: v for k, v in sizes.items() if k != "intermediate_size"}
        # Untied pre-norm: tied to embeddings this large (std 0.5), it would only echo its last token.
        opt.update(max_position_embeddings=256, tie_word_embeddings=arch == "opt_post")
        cfg = transformers.OPTConfig(
            **opt,
            ffn_dim=common["intermediate_size"],
            do_layer_norm_before=arch == "opt",
            word_embed_proj_dim=common["hidden_size"] // 2 if arch == "opt_post" else None,
        )
        return cfg, transformers.OPTForCausalLM
    if arch == "olmoe":
        moe = dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=False)
        return transformers.OlmoeConfig(**common, **moe), transformers.OlmoeForCausalLM
    if arch == "nemotron":
        cfg = transformers.NemotronConfig(
            **sizes,
            num_key_value_heads=common["num_key_value_heads"],
            norm_eps=1e-5,
            partial_rotary_factor=0.5,
            attention_bias=True,
            mlp_bias=True,
        )
        return cfg, transformers.NemotronForCausalLM
    raise ValueError(f"unknown tiny architecture {arch!r}")
