"""Config defaults of the architectures read through the Llama, OLMo and Gemma models, as transformers'
own config classes fill them in (a config.json leaves out what equals its class default)."""

from __future__ import annotations

import pytest

from engine.models.config import ModelConfig

BASE = {
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


@pytest.mark.parametrize(
    "arch,model_type",
    [
        ("SeedOssForCausalLM", "seed_oss"),
        ("Glm4ForCausalLM", "glm4"),
        ("Ernie4_5ForCausalLM", "ernie4_5"),
        ("Olmo3ForCausalLM", "olmo3"),
        ("SmolLM3ForCausalLM", "smollm3"),
        ("Ernie4_5_MoeForCausalLM", "ernie4_5_moe"),
        ("GraniteForCausalLM", "granite"),
        ("GraniteMoeForCausalLM", "granitemoe"),
        ("GemmaForCausalLM", "gemma"),
        ("Exaone4ForCausalLM", "exaone4"),
        ("HunYuanDenseV1ForCausalLM", "hunyuan_v1_dense"),
        ("MiniMaxM2ForCausalLM", "minimax_m2"),
        ("ArceeForCausalLM", "arcee"),
        ("Starcoder2ForCausalLM", "starcoder2"),
        ("CohereForCausalLM", "cohere"),
        ("Cohere2ForCausalLM", "cohere2"),
        ("ApertusForCausalLM", "apertus"),
        ("Dots1ForCausalLM", "dots1"),
    ],
)
def test_config_defaults_as_transformers_fills_them(arch: str, model_type: str) -> None:
    """A config.json naming only the sizes means to ferry what it means to transformers' config class
    (whose defaults differ from Llama's: biases, head_dim, ties, partial rotary, NoPE layers)."""
    from transformers import AutoConfig

    raw = {**BASE, "num_hidden_layers": 4, "architectures": [arch], "model_type": model_type}
    ours = ModelConfig.from_dict(raw)
    hf = AutoConfig.for_model(model_type, **{k: v for k, v in raw.items() if k != "model_type"})
    assert ours.head_dim == (getattr(hf, "head_dim", None) or 16)
    assert ours.tie_word_embeddings == hf.tie_word_embeddings
    assert ours.rms_norm_eps == next(
        getattr(hf, n) for n in ("rms_norm_eps", "norm_epsilon", "layer_norm_eps") if hasattr(hf, n)
    )
    if model_type in ("arcee", "starcoder2", "apertus"):  # ungated MLPs, whose activation the model reads
        assert ours.hidden_act == hf.hidden_act
    assert ours.max_position_embeddings == hf.max_position_embeddings
    assert ours.attention_bias == bool(getattr(hf, "attention_bias", getattr(hf, "use_bias", False)))
    params = hf.rope_parameters
    if model_type == "olmo3":
        assert ours.layer_rope == tuple((params[t]["rope_theta"], None) for t in hf.layer_types)
    elif model_type in ("exaone4", "cohere2"):  # rotary on the sliding layers only
        rope = (params["rope_theta"], None)
        assert ours.layer_rope == tuple(rope if t == "sliding_attention" else None for t in hf.layer_types)
        assert ours.layer_windows == tuple(4096 if t == "sliding_attention" else None for t in hf.layer_types)
    elif model_type == "smollm3":
        rope = (params["rope_theta"], None)
        assert ours.layer_rope == tuple(rope if flag else None for flag in hf.no_rope_layers)
        assert ours.layer_rope[3] is None  # every fourth layer NoPE
    else:
        assert ours.rope_theta == params["rope_theta"] and not ours.layer_rope
        if model_type == "apertus":  # llama3-scaled by default
            assert {k: v for k, v in ours.rope_scaling.items() if k != "rope_theta"} == {
                k: v for k, v in params.items() if k != "rope_theta"
            }
    assert ours.partial_rotary_factor == params.get("partial_rotary_factor", 1.0)
    assert ours.rope_interleave == (model_type in ("glm4", "ernie4_5", "ernie4_5_moe", "cohere", "cohere2"))
    assert ours.logit_scale == getattr(hf, "logit_scale", 1.0)
    assert ours.attention_multiplier == getattr(hf, "attention_multiplier", None)
    if ours.moe is not None:
        assert ours.moe.num_experts == hf.num_experts if hasattr(hf, "num_experts") else hf.num_local_experts
        assert ours.moe.experts_per_token == hf.num_experts_per_tok
    if model_type == "minimax_m2":  # the releases' rotary_dim spelling of a partial rotary
        hf = AutoConfig.for_model(
            model_type, **{k: v for k, v in raw.items() if k != "model_type"}, rotary_dim=64
        )
        factor = ModelConfig.from_dict({**raw, "rotary_dim": 64}).partial_rotary_factor
        assert factor == hf.rope_parameters["partial_rotary_factor"] == 0.5
    if model_type == "ernie4_5_moe":  # layers moe_layer_start_index.. are MoE
        moe = [ours.moe.is_moe_layer(i) for i in range(4)]
        assert moe == [i >= hf.moe_layer_start_index for i in range(4)]
        assert ours.moe.num_shared_experts == hf.moe_num_shared_experts


def test_olmo3_transformers_4_rope_scaling_is_for_full_layers_only() -> None:
    yarn = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192}
    raw = {
        **BASE,
        "architectures": ["Olmo3ForCausalLM"],
        "model_type": "olmo3",
        "rope_theta": 500000.0,
        "rope_scaling": yarn,
        "layer_types": ["sliding_attention", "full_attention"],
    }
    assert ModelConfig.from_dict(raw).layer_rope == ((500000.0, None), (500000.0, yarn))


def test_each_architecture_resolves_to_its_model() -> None:
    from engine.models.registry import get_model_class, supported_architectures

    expected = {
        "SeedOssForCausalLM": "LlamaForCausalLM",
        "SmolLM3ForCausalLM": "LlamaForCausalLM",
        "Glm4ForCausalLM": "LlamaForCausalLM",
        "Ernie4_5ForCausalLM": "LlamaForCausalLM",
        "Ernie4_5_MoeForCausalLM": "LlamaForCausalLM",
        "GraniteMoeForCausalLM": "LlamaForCausalLM",
        "HunYuanDenseV1ForCausalLM": "LlamaForCausalLM",
        "MiniMaxM2ForCausalLM": "LlamaForCausalLM",
        "Olmo3ForCausalLM": "Olmo2ForCausalLM",
        "Exaone4ForCausalLM": "Olmo2ForCausalLM",
        "GemmaForCausalLM": "GemmaForCausalLM",
    }
    for arch, cls in expected.items():
        assert arch in supported_architectures()
        assert get_model_class(arch).__name__ == cls


def test_biases_on_every_projection_are_refused() -> None:
    raw = {**BASE, "architectures": ["Ernie4_5ForCausalLM"], "model_type": "ernie4_5", "use_bias": True}
    with pytest.raises(ValueError, match="use_bias"):
        ModelConfig.from_dict(raw)


def test_dots1_router_and_windows_as_transformers_reads_them() -> None:
    """dots.llm1: DeepSeek-V3's router without renormalised top-k weights by default; the layers from
    max_window_layers on slide (all full with no window)."""
    from transformers import Dots1Config

    moe = {
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "n_shared_experts": 1,
    }
    raw = {
        **BASE,
        "num_hidden_layers": 4,
        "architectures": ["Dots1ForCausalLM"],
        "model_type": "dots1",
        **moe,
    }
    for extra in ({}, {"sliding_window": 16, "max_window_layers": 2}, {"sliding_window": None}):
        ours = ModelConfig.from_dict({**raw, **extra})
        hf = Dots1Config(**{k: v for k, v in {**raw, **extra}.items() if k != "model_type"})
        assert ours.moe.norm_topk_prob == hf.norm_topk_prob is False
        assert ours.moe.scoring == "sigmoid" and ours.moe.topk_method == "noaux_tc"
        assert ours.num_kv_heads == hf.num_key_value_heads
        window = hf.sliding_window
        assert ours.layer_windows == tuple(
            window if t == "sliding_attention" else None for t in hf.layer_types
        )
    assert ours.layer_windows == (None,) * 4
