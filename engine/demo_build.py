"""``build_model``: a random-weight tiny Hugging Face checkpoint of one of the architectures ferry
serves (config, safetensors, the demo tokenizer), for the demo model and the tests. Imports torch and
transformers only when called: ``engine.demo`` re-exports it and must stay torch-free to import.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from engine import demo_archs_alibi, demo_archs_llama4
from engine.demo_archs import ARCHS, arch_config
from engine.demo_archs_classic import ARCHS as CLASSIC_ARCHS
from engine.demo_archs_classic import arch_config as classic_config
from engine.demo_archs_learned import ARCHS as LEARNED_ARCHS
from engine.demo_archs_learned import NORMS as LEARNED_NORMS
from engine.demo_archs_learned import arch_config as learned_arch_config
from engine.demo_archs_textonly import ARCHS as TEXT_ONLY_ARCHS
from engine.demo_archs_textonly import arch_config as text_only_config
from engine.demo_archs_variants import ARCHS as VARIANT_ARCHS
from engine.demo_archs_variants import arch_config as variant_config
from engine.demo_tokenizer import build_tokenizer


def build_model(
    out_dir: str | os.PathLike,
    arch: str = "llama",
    *,
    seed: int = 0,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 1024,
    dtype: str = "float32",
    rope_scaling: dict | None = None,
    tokenizer_vocab_size: int = 1000,
    extra_tokens: Sequence[str] = (),
    num_labels: int | None = None,
    id2label: dict[int, str] | None = None,
) -> Path:
    """Write a random-weight HF checkpoint (config, safetensors, tokenizer) for ``arch``; with
    ``num_labels``, its ``*ForSequenceClassification`` (a ``score`` head, labels ``id2label``).

    ``arch`` is "llama", "qwen2" (attention q/k/v bias), "deepseek_v3" (MLA + MoE: 8 routed
    experts in 2 groups, 2 per token, 1 shared; layer 0 dense; ``rope_scaling`` may be YaRN),
    "deepseek_v2" (softmax router, group-limited), "deepseek_v2_lite" (no q_lora_rank, greedy),
    "qwen3" (per-head q/k norm), "qwen3_moe" (8 experts, 2 per token; layer 0 dense), "mixtral"
    (4 experts, 2 per token), "qwen2_moe" (a gated shared expert too), "phi3" (fused weights,
    partial rotary 0.75), "gemma3" (text; local/global layers, soft-capped logits) or "gemma3_mm"
    (the same text model inside a Gemma3ForConditionalGeneration checkpoint), "gemma2" (soft-capped
    attention), "glm4_moe" (GLM-4.5),
    "granite" (Llama with embedding, attention, residual and logit multipliers), "olmo2" or
    "gpt_oss" (attention sinks, sliding (window 8) and full layers, q/k/v/o biases, YaRN, a biased
    router over 4 biased experts, 2 per token, with a clamped SwiGLU), or one of
    ``engine.demo_archs.ARCHS`` (Seed-OSS, OLMo 3, SmolLM3, GLM-4, ERNIE 4.5 and its MoE, Granite-MoE,
    Gemma 1, EXAONE 4, Hunyuan dense, MiniMax-M2, Arcee, StarCoder2, Command R and R7B, Apertus,
    dots.llm1), of ``engine.demo_archs_classic.ARCHS`` (GPT-NeoX, Phi, StableLM, GPT-J), of
    ``engine.demo_archs_learned.ARCHS`` (GPT-2, OPT, OLMoE, Nemotron), of ``engine.demo_archs_llama4``'s
    (Llama 4, Phi-3.5-MoE), of ``engine.demo_archs_textonly.ARCHS`` (Mistral 3, Qwen2-VL, Qwen2.5-VL,
    Qwen3-VL and its MoE: vision checkpoints served text-only), of ``engine.demo_archs_variants.ARCHS``
    (OLMo 1, GLM-4-9B, Helium, Ministral, Ministral 3, Falcon) or of ``engine.demo_archs_alibi.ARCHS``
    (Bloom, MPT).
    The model's eos is ``<|im_end|>``.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, vocab_size=tokenizer_vocab_size, extra_tokens=extra_tokens)
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(out))
    vocab = len(tok)
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        bos_token_id=None,
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        rms_norm_eps=1e-6,
    )
    if arch == "llama":
        cfg = LlamaConfig(**common)
        if rope_scaling:
            cfg.rope_parameters = {"rope_theta": 10000.0, **rope_scaling}
        cls = LlamaForCausalLM
    elif arch == "qwen2":
        cfg = Qwen2Config(**common)
        cls = Qwen2ForCausalLM
    elif arch in ("gemma3", "gemma3_mm"):
        import transformers

        # A sliding (window 8) and a full layer, each with its rope; linear scaling on the full one.

        cfg = transformers.Gemma3TextConfig(
            **common,
            head_dim=hidden_size // num_attention_heads,
            query_pre_attn_scalar=hidden_size // num_attention_heads,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * (num_hidden_layers // 2),
            final_logit_softcapping=30.0,
        )
        cfg.rope_parameters = {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1_000_000.0, "factor": 2.0},
        }
        cls = transformers.Gemma3ForCausalLM
        if arch == "gemma3_mm":  # the multimodal checkpoint's layout, a tiny SigLIP vision tower
            vision = transformers.SiglipVisionConfig(
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=28,
                patch_size=14,
            )
            special = {
                "image_token_index": vocab - 1,
                "boi_token_index": vocab - 3,
                "eoi_token_index": vocab - 2,
            }
            cfg = transformers.Gemma3Config(
                text_config=cfg.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4, **special
            )
            cls = transformers.Gemma3ForConditionalGeneration
    elif arch == "glm4_moe":  # GLM-4.5: q/k/v bias, half-rotary heads, q/k norm; V3-style MoE, layer 0 dense
        import transformers

        cfg = transformers.Glm4MoeConfig(
            **common,
            head_dim=hidden_size // num_attention_heads,
            partial_rotary_factor=0.5,
            attention_bias=True,
            use_qk_norm=True,
            moe_intermediate_size=intermediate_size // 4,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.0,
        )
        cls = transformers.Glm4MoeForCausalLM
    elif arch == "gemma2":  # sliding (window 8) and full layers; small caps so the soft-capping matters
        import transformers

        cfg = transformers.Gemma2Config(
            **common,
            head_dim=hidden_size // num_attention_heads,
            query_pre_attn_scalar=hidden_size // num_attention_heads,
            sliding_window=8,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=5.0,
        )
        cls = transformers.Gemma2ForCausalLM
    elif arch == "gpt_oss":  # sinks, sliding (window 8) and full layers, biased MoE (4 experts, 2 per token)
        import transformers

        cfg = transformers.GptOssConfig(
            **{**common, "rms_norm_eps": 1e-5},
            head_dim=hidden_size // num_attention_heads,
            sliding_window=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            swiglu_limit=_gpt_oss_swiglu_limit(0.5),  # small enough that random weights hit the clamps
        )
        cfg.rope_parameters = rope_scaling or {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 256,
        }
        cls = transformers.GptOssForCausalLM
    elif arch == "olmo2":  # norms after attention and MLP, q/k normalised over whole projections
        import transformers

        cfg, cls = transformers.Olmo2Config(**common), transformers.Olmo2ForCausalLM
    elif arch == "granite":  # Llama with Granite's four multipliers, none of them 1
        import transformers

        scalings = dict(
            embedding_multiplier=2.0, attention_multiplier=0.1, residual_multiplier=0.5, logits_scaling=1.5
        )
        cfg, cls = transformers.GraniteConfig(**common, **scalings), transformers.GraniteForCausalLM
    elif arch == "phi3":  # fused qkv_proj / gate_up_proj, a quarter of each head not rotated
        import transformers

        cfg = transformers.Phi3Config(**common, partial_rotary_factor=0.75)
        cls = transformers.Phi3ForCausalLM
    elif arch == "qwen2_moe":  # 8 experts, 2 per token, a gated shared expert; layer 0 dense
        import transformers

        moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=intermediate_size // 4)
        shared = dict(shared_expert_intermediate_size=intermediate_size // 2, mlp_only_layers=[0])
        cfg, cls = transformers.Qwen2MoeConfig(**common, **moe, **shared), transformers.Qwen2MoeForCausalLM
    elif arch == "mixtral":  # 4 experts, 2 per token
        import transformers

        moe = dict(num_local_experts=4, num_experts_per_tok=2)
        cfg, cls = transformers.MixtralConfig(**common, **moe), transformers.MixtralForCausalLM
    elif arch in ("qwen3", "qwen3_moe"):
        import transformers

        head_dim = hidden_size // num_attention_heads  # Qwen3Config's default is 128
        if arch == "qwen3":
            cfg, cls = transformers.Qwen3Config(**common, head_dim=head_dim), transformers.Qwen3ForCausalLM
        else:  # 8 experts, 2 per token, normalised; layer 0 dense (mlp_only_layers)
            moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=intermediate_size // 4)
            cfg = transformers.Qwen3MoeConfig(
                **common, head_dim=head_dim, **moe, norm_topk_prob=True, mlp_only_layers=[0]
            )
            cls = transformers.Qwen3MoeForCausalLM
    elif arch.startswith("deepseek"):
        import transformers

        mla_moe = dict(
            moe_intermediate_size=intermediate_size // 4,
            q_lora_rank=hidden_size // 2,
            kv_lora_rank=hidden_size // 4,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
        )
        if arch == "deepseek_v3":
            version = "V3"
        elif arch == "deepseek_v2":
            version, mla_moe["topk_method"] = "V2", "group_limited_greedy"
        elif arch == "deepseek_v2_lite":  # V2-Lite's shape: no query compression, plain top-k
            version, mla_moe["topk_method"], mla_moe["q_lora_rank"] = "V2", "greedy", None
        else:
            raise ValueError(f"unknown tiny architecture {arch!r}")
        cfg = getattr(transformers, f"Deepseek{version}Config")(
            **{**common, "num_key_value_heads": num_attention_heads}, **mla_moe
        )
        if rope_scaling:
            cfg.rope_parameters = {"rope_theta": 10000.0, **rope_scaling}
        cls = getattr(transformers, f"Deepseek{version}ForCausalLM")
    elif arch in ARCHS:
        cfg, cls = arch_config(arch, common, hidden_size // num_attention_heads)
    elif arch in CLASSIC_ARCHS:
        cfg, cls = classic_config(arch, common, hidden_size // num_attention_heads)
    elif arch in LEARNED_ARCHS:  # GPT-2, OPT, OLMoE, Nemotron
        cfg, cls = learned_arch_config(arch, common, hidden_size // num_attention_heads)
    elif arch in demo_archs_llama4.ARCHS:
        cfg, cls = demo_archs_llama4.arch_config(arch, common, hidden_size // num_attention_heads)
    elif arch in TEXT_ONLY_ARCHS:
        cfg, cls = text_only_config(arch, common, hidden_size // num_attention_heads)
    elif arch in VARIANT_ARCHS:
        cfg, cls = variant_config(arch, common, hidden_size // num_attention_heads)
    elif arch in demo_archs_alibi.ARCHS:  # Bloom, MPT
        cfg, cls = demo_archs_alibi.arch_config(arch, common, hidden_size // num_attention_heads)
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}")
    if num_labels is not None:
        import transformers

        cfg.num_labels = num_labels
        if id2label is not None:
            cfg.id2label, cfg.label2id = dict(id2label), {v: k for k, v in id2label.items()}
        cls = getattr(transformers, cls.__name__.replace("ForCausalLM", "ForSequenceClassification"))
    torch.manual_seed(seed)
    model = cls(cfg)
    # Larger-than-default init so random models produce varied, non-degenerate tokens. Gemma 1 scales
    # embeddings by sqrt(hidden) and has no norm after attention: at 0.5 they would drown it out.
    embed_std = 0.06 if arch == "gemma" else 0.5
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08 if "embed" not in name else embed_std)
            elif "norm" in name and arch.startswith("gemma"):  # offsets from 1, zero at init
                p.normal_(0.0, 0.1)
            elif "bias" in name:
                p.normal_(0.0, 0.05)
            elif name.endswith("sinks"):  # large enough to take a visible share of attention
                p.normal_(0.0, 1.0)
            elif name.endswith(("act_fn.alpha_p", "act_fn.alpha_n")):  # Apertus' xIELU: differ per layer
                p.normal_(0.0, 1.0)
            elif ("norm" in name and arch in ("starcoder2", "cohere", "cohere2")) or (
                arch in LEARNED_ARCHS and any(n in name for n in LEARNED_NORMS)
            ):  # LayerNorms: not all 1
                p.normal_(1.0, 0.2)
            elif arch in CLASSIC_ARCHS or arch in VARIANT_ARCHS or arch in demo_archs_alibi.ARCHS:
                # LayerNorm weights (GPT-J's ln_1 too): not all 1
                p.normal_(1.0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zero at init: make it matter (DeepSeek, GLM)
                b.normal_(0.0, 0.1)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def _gpt_oss_swiglu_limit(wanted: float) -> float:
    """``wanted`` where transformers' gpt-oss reads ``swiglu_limit`` from the config, else the 7.0
    that older releases (5.17 among them) hard-code: a checkpoint made here must mean the same to
    transformers as to ferry, which reads the config."""
    import transformers
    from transformers.models.gpt_oss import modeling_gpt_oss

    probe = transformers.GptOssConfig(
        hidden_size=4, intermediate_size=4, num_local_experts=1, swiglu_limit=wanted
    )
    return wanted if modeling_gpt_oss.GptOssExperts(probe).limit == wanted else 7.0
