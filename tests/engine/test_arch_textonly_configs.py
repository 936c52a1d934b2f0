"""The config.json of vision-language checkpoints served text-only (engine/models/config_vision_text.py)
read as transformers 5's config classes read their text model: nested ``text_config`` or transformers
4's flat Qwen2-VL spelling, class defaults for what is left out, M-RoPE's keys; and what ferry refuses.
"""

from __future__ import annotations

from typing import Any

import pytest

from engine.models.config import ModelConfig

SIZES = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4}
VISION = {"depth": 1}  # the vision side is not read; transformers needs none of it either


def _hf_text(raw: dict[str, Any]) -> Any:
    import transformers

    cls = getattr(transformers, raw["architectures"][0].replace("ForConditionalGeneration", "Config"))
    return cls.from_dict({k: v for k, v in raw.items() if k != "architectures"}).text_config


CASES = [
    # Mistral Small 3.1's shape, its text_config written in part: MistralConfig fills the rest (a window
    # of 4096 among them).
    {
        "architectures": ["Mistral3ForConditionalGeneration"],
        "text_config": {**SIZES, "model_type": "mistral", "num_attention_heads": 4, "head_dim": 32},
    },
    {  # no text_config at all: Mistral3Config's own text model (Mistral Small 3.1's)
        "architectures": ["Mistral3ForConditionalGeneration"],
    },
    {  # transformers 4's flat Qwen2-VL, the rope under rope_scaling as "mrope"; no window used
        "architectures": ["Qwen2VLForConditionalGeneration"],
        **SIZES,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_theta": 1_000_000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "use_sliding_window": False,
        "sliding_window": 32768,
        "max_window_layers": 2,
        "vision_config": VISION,
    },
    {  # Qwen2.5-VL with its window on the layers from max_window_layers on
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "text_config": {
            **SIZES,
            "num_attention_heads": 4,
            "use_sliding_window": True,
            "sliding_window": 16,
            "max_window_layers": 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        },
    },
    {  # Qwen3-VL: head_dim left out is Qwen3VLTextConfig's 128, not hidden / heads
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "text_config": {
            **SIZES,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5_000_000.0,
                "mrope_section": [24, 20, 20],
                "mrope_interleaved": True,
            },
        },
    },
    {  # Qwen3-VL-MoE: the expert counts left out are the class's (60 experts, 4 per token)
        "architectures": ["Qwen3VLMoeForConditionalGeneration"],
        "text_config": {
            **SIZES,
            "num_attention_heads": 4,
            "moe_intermediate_size": 32,
            "mlp_only_layers": [1],
        },
    },
]


@pytest.mark.parametrize("raw", CASES, ids=lambda raw: raw["architectures"][0])
def test_text_config_as_transformers_reads_it(raw: dict[str, Any]) -> None:
    ours, hf = ModelConfig.from_dict(raw), _hf_text(raw)
    assert (ours.vocab_size, ours.hidden_size, ours.intermediate_size) == (
        hf.vocab_size,
        hf.hidden_size,
        hf.intermediate_size,
    )
    assert (ours.num_layers, ours.num_heads, ours.num_kv_heads) == (
        hf.num_hidden_layers,
        hf.num_attention_heads,
        hf.num_key_value_heads,
    )
    qwen2 = raw["architectures"][0].startswith("Qwen2")  # its attention splits hidden_size into the heads
    assert ours.head_dim == (hf.hidden_size // hf.num_attention_heads if qwen2 else hf.head_dim)
    assert (ours.rms_norm_eps, ours.max_position_embeddings) == (hf.rms_norm_eps, hf.max_position_embeddings)
    assert (ours.rope_theta, ours.rope_scaling) == (hf.rope_parameters["rope_theta"], None)
    assert hf.rope_parameters["rope_type"] == "default"
    types = getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers
    window = getattr(hf, "sliding_window", None)
    if raw["architectures"][0].startswith("Mistral3"):  # MistralAttention windows every layer
        types = ["sliding_attention"] * hf.num_hidden_layers
    assert ours.layer_windows == tuple(window if t == "sliding_attention" and window else None for t in types)
    assert ours.attention_bias == qwen2  # Qwen2-VL's q/k/v always have biases
    assert ours.vision is None  # text-only: an image is a 400
    assert not ours.tie_word_embeddings  # the checkpoint's lm_head when it has one (see the module)
    if "Moe" in raw["architectures"][0]:
        assert ours.moe is not None
        assert (ours.moe.num_experts, ours.moe.experts_per_token, ours.moe.intermediate_size) == (
            hf.num_experts,
            hf.num_experts_per_tok,
            hf.moe_intermediate_size,
        )
        assert ours.moe.norm_topk_prob
        assert [ours.moe.is_moe_layer(i) for i in range(4)] == [True, False, True, True]


def test_windows_of_the_cases() -> None:
    """The cases above do exercise windows: Mistral's default 4096 on every layer, Qwen2.5-VL's from
    max_window_layers on, none for the flat Qwen2-VL (use_sliding_window false)."""
    windows = [ModelConfig.from_dict(raw).layer_windows for raw in CASES]
    assert windows[0] == (4096,) * 4
    assert windows[1] == (None,) * 40
    assert windows[2] == (None,) * 4
    assert windows[3] == (None, None, 16, 16)


def test_ministral3_text_model_reads_as_ministral3_and_other_text_models_are_refused() -> None:
    """Ministral 3 ships as Mistral3ForConditionalGeneration: its text model's YaRN and Llama 4's query
    scaling come from Ministral3Config's defaults when left out; any other text model is refused."""
    raw = {
        "architectures": ["Mistral3ForConditionalGeneration"],
        "text_config": {**SIZES, "model_type": "ministral3", "num_attention_heads": 4},
    }
    cfg = ModelConfig.from_dict(raw)
    assert cfg.query_position_scale == (0.1, 16384)
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "yarn"
    assert cfg.rope_scaling["factor"] == 16.0 and cfg.rope_theta == 1_000_000.0
    assert cfg.head_dim == 128 and cfg.num_kv_heads == 8
    raw["text_config"]["model_type"] = "llama"
    with pytest.raises(ValueError, match="text_config.model_type 'llama' is not supported"):
        ModelConfig.from_dict(raw)


def test_qwen2_vl_mrope_section_must_cover_half_a_head() -> None:
    """transformers' Qwen2-VL rotary cannot split a 16-dim head's 8 frequencies into [4, 4, 4]."""
    raw = {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "text_config": {
            **SIZES,
            "num_attention_heads": 4,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 4, 4]},
        },
    }
    with pytest.raises(
        ValueError, match=r"mrope_section \[4, 4, 4\] does not add up to half the head dim \(8\)"
    ):
        ModelConfig.from_dict(raw)
