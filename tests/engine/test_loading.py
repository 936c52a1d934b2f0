"""Model loading: config spellings, architectures, hub ids, weights identity and the fingerprint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.models.config import ModelConfig
from engine.models.loader import _samples, resolve_model_dir, weights_id
from kvcache.keys import model_fingerprint

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def test_config_reads_transformers_4_and_5_spellings() -> None:
    v4 = ModelConfig.from_dict(
        {
            **BASE,
            "rope_theta": 500000.0,
            "torch_dtype": "bfloat16",
            "rope_scaling": {"type": "linear", "factor": 2.0},
        }
    )
    v5 = ModelConfig.from_dict(
        {
            **BASE,
            "dtype": "bfloat16",
            "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0},
        }
    )
    for c in (v4, v5):
        assert c.rope_theta == 500000.0 and c.checkpoint_dtype == "bfloat16"
        assert c.rope_scaling["rope_type"] == "linear" and c.rope_scaling["factor"] == 2.0
        assert (c.head_dim, c.num_kv_heads) == (16, 2)
    plain = ModelConfig.from_dict({**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert plain.rope_scaling is None and plain.rope_theta == 1e4
    assert ModelConfig.from_dict(
        {**BASE, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
    ).attention_bias


def _copy(src: Path, dst: Path, **config_changes) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        shutil.copy(f, dst / f.name)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(config_changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_mistral_architecture_runs_as_llama(tiny_llama, tmp_path, prompts) -> None:
    mistral = _copy(tiny_llama, tmp_path / "m", architectures=["MistralForCausalLM"], model_type="mistral")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    a = LLM(str(tiny_llama), num_kv_blocks=64).generate(prompts[5], params)[0].outputs[0].token_ids
    b = LLM(str(mistral), num_kv_blocks=64).generate(prompts[5], params)[0].outputs[0].token_ids
    assert a == b


def test_unsupported_architecture_is_named(tiny_llama, tmp_path) -> None:
    bad = _copy(tiny_llama, tmp_path / "b", architectures=["RwkvForCausalLM"])
    with pytest.raises(ValueError, match="unsupported architecture 'RwkvForCausalLM'"):
        LLM(str(bad), num_kv_blocks=8)


def test_hub_id_without_network_names_the_id(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"'no-such-org/no-such-model'.*pass a local model directory"):
        LLM("no-such-org/no-such-model")


def test_hub_revision_missing_from_the_cache_is_named(tmp_path, monkeypatch) -> None:
    """--revision / --download-dir reach the download: without network, a revision the cache holds
    resolves to its snapshot (tests/server/test_vllm_flags_chat.py serves one), another is named."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = tmp_path / "models--ferry-test--tiny"
    (repo / "snapshots" / ("a" * 40)).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    assert resolve_model_dir("ferry-test/tiny", None, str(tmp_path)) == repo / "snapshots" / ("a" * 40)
    with pytest.raises(ValueError, match=r"'ferry-test/tiny' at revision 'v9' is not a local directory"):
        resolve_model_dir("ferry-test/tiny", "v9", str(tmp_path))


def test_weights_id_and_fingerprint(tiny_llama, tiny_qwen2, tmp_path) -> None:
    wid = weights_id(tiny_llama)
    assert wid == weights_id(tiny_llama) and len(wid) == 32
    assert wid != weights_id(tiny_qwen2)
    changed = _copy(tiny_llama, tmp_path / "c", rms_norm_eps=1e-5)
    assert weights_id(changed) != wid
    llm = LLM(str(tiny_llama), num_kv_blocks=8, block_size=16)
    runner = llm.engine.model_runner
    assert runner.weights_id == wid
    expected = model_fingerprint(
        weights_id=wid, dtype="float32", block_size=16, num_layers=2, num_kv_heads=2, head_dim=16
    )
    assert llm.engine.model_fingerprint == expected == llm.engine.model_info.model_fingerprint
    other = LLM(str(tiny_llama), num_kv_blocks=8, block_size=8)
    assert other.engine.model_fingerprint != expected


def _checkpoint(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def test_weights_id_samples_tensor_bytes(tmp_path) -> None:
    """Same names, shapes and sizes (a fine-tune, a checkpoint retrained in place): another id."""
    g = torch.Generator().manual_seed(0)
    w, norm = torch.randn(256, 256, generator=g), torch.randn(64, generator=g)  # 256 KiB, 256 B
    base = weights_id(_checkpoint(tmp_path / "a", {"w": w, "norm": norm}))
    assert weights_id(_checkpoint(tmp_path / "b", {"w": w.clone(), "norm": norm.clone()})) == base
    assert weights_id(_checkpoint(tmp_path / "c", {"w": w * 1.01, "norm": norm})) != base
    one = norm.clone()
    one[63] += 1.0  # a small tensor is read whole
    assert weights_id(_checkpoint(tmp_path / "d", {"w": w, "norm": one})) != base
    # A large tensor is read in 16 slices of 4 KiB from 0 to its end (step (262144 - 4096) / 15
    # bytes): a change to one element between two slices goes unseen, one inside a slice does not.
    assert _samples(256 * 256 * 4)[:3] == [(0, 4096), (17203, 4096), (34406, 4096)]
    assert _samples(256 * 256 * 4)[-1] == (258048, 4096) and _samples(65536) == [(0, 65536)]
    between, inside = w.clone(), w.clone()
    between.view(-1)[10000 // 4] += 1.0
    inside.view(-1)[17204 // 4 + 1] += 1.0
    assert weights_id(_checkpoint(tmp_path / "e", {"w": between, "norm": norm})) == base
    assert weights_id(_checkpoint(tmp_path / "f", {"w": inside, "norm": norm})) != base


def test_kv_cache_layout_and_sizing(tiny_llama) -> None:
    llm = LLM(str(tiny_llama), kv_cache_memory_bytes=1 << 20, block_size=16)
    runner = llm.engine.model_runner
    per_block = 2 * 2 * 16 * 2 * 16 * 4  # k+v, layers, block, kv heads, head dim, fp32
    assert runner.bytes_per_block == per_block
    assert runner.num_kv_blocks == (1 << 20) // per_block
    k, v = runner.kv_caches[0]
    assert tuple(k.shape) == (runner.num_kv_blocks, 16, 2, 16) and k.shape == v.shape
    assert len(runner.kv_caches) == 2


def test_demo_model_when_model_is_none(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("FERRY_CACHE_DIR", str(tmp_path))
    llm = LLM(None, num_kv_blocks=32)
    assert str(llm.engine.model_dir).startswith(str(tmp_path))
    out = llm.generate("hello", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 3


def test_sliding_window_keeps_the_full_context_and_mlp_bias_is_refused(tiny_llama, tmp_path) -> None:
    windowed = _copy(
        tiny_llama,
        tmp_path / "w",
        architectures=["MistralForCausalLM"],
        model_type="mistral",
        sliding_window=256,
    )
    engine = LLM(str(windowed), num_kv_blocks=8).engine
    assert engine.max_model_len == 1024  # max_position_embeddings: the window is applied, not a cap
    assert engine.model_runner.model_config.layer_windows == (256, 256)
    qwen_like = ModelConfig.from_dict(
        {**BASE, "model_type": "qwen2", "sliding_window": 64, "use_sliding_window": False}
    )
    assert qwen_like.sliding_window is None and qwen_like.layer_windows == (None, None)
    with pytest.raises(ValueError, match="mlp_bias"):
        ModelConfig.from_dict({**BASE, "mlp_bias": True})


@pytest.mark.parametrize(
    ("option", "value", "low"),
    [
        ("block_size", 0, 1),
        ("kv_cache_memory_bytes", 0, 1),
        ("max_num_seqs", 0, 1),
        ("max_num_batched_tokens", -1, 1),
        ("long_prefill_token_threshold", -1, 0),
        ("kv_tier_write_queue", 0, 1),
        ("max_logprobs", -1, 0),
        ("num_kv_blocks", 0, 1),
        ("max_model_len", 0, 1),
        ("num_threads", 0, 1),
        ("block_size", 2.5, 1),
        ("max_num_seqs", True, 1),
    ],
)
def test_engine_options_out_of_range_are_named(option: str, value: object, low: int) -> None:
    with pytest.raises(ValueError, match=rf"^{option} must be an integer >= {low}, got {value!r}$"):
        EngineConfig.from_options(**{option: value})


def test_max_model_len_beyond_the_trained_positions_is_refused(tiny_llama, tmp_path) -> None:
    # tiny_llama is trained for 1024 positions.
    with pytest.raises(
        ValueError,
        match=r"max_model_len=1025 is more than the 1024 positions of the model \(max_position_embeddings=1024\)",
    ):
        LLM(str(tiny_llama), num_kv_blocks=8, max_model_len=1025)
    assert LLM(str(tiny_llama), num_kv_blocks=8, max_model_len=1024).engine.max_model_len == 1024
    assert LLM(str(tiny_llama), num_kv_blocks=8).engine.max_model_len == 1024
    # Linear rope scaling stretches the positions by its factor.
    linear = _copy(tiny_llama, tmp_path / "lin", rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert LLM(str(linear), num_kv_blocks=8).engine.max_model_len == 2048
    with pytest.raises(ValueError, match=r"2048 positions .*=1024 x linear rope scaling factor 2\)"):
        LLM(str(linear), num_kv_blocks=8, max_model_len=2049)


def test_layers_past_num_hidden_layers_are_not_read(tiny_deepseek, tmp_path) -> None:
    """DeepSeek-V3 checkpoints carry a multi-token-prediction layer after the decoder's
    (``model.layers.61``): it is never loaded, and router weights stay fp32 in a bf16 model."""
    from safetensors.torch import load_file, save_file

    from engine.models.loader import load_weights

    extra = tmp_path / "mtp"
    shutil.copytree(tiny_deepseek, extra)
    weights = load_file(str(extra / "model.safetensors"))
    weights["model.layers.2.eh_proj.weight"] = torch.ones(4, 4)
    weights["model.layers.2.self_attn.q_a_proj.weight"] = torch.ones(4, 4)
    save_file(weights, str(extra / "model.safetensors"))
    loaded = load_weights(extra, torch.bfloat16, torch.device("cpu"), ("mlp.gate.weight",), num_layers=2)
    assert not [n for n in loaded if n.startswith("model.layers.2.")]
    assert set(loaded) == set(weights) - {
        "model.layers.2.eh_proj.weight",
        "model.layers.2.self_attn.q_a_proj.weight",
    }
    assert loaded["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert loaded["model.layers.1.self_attn.kv_b_proj.weight"].dtype == torch.bfloat16
    llm = LLM(str(extra), num_kv_blocks=16)
    assert (
        len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids)
        == 3
    )


def test_qwen3_windows_and_moe_layers_as_transformers_reads_them() -> None:
    qwen3 = {**BASE, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_hidden_layers": 4}
    assert ModelConfig.from_dict(qwen3).layer_windows == (None,) * 4  # use_sliding_window defaults off
    sliding = {**qwen3, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}
    assert ModelConfig.from_dict(sliding).layer_windows == (None, None, 8, 8)
    moe = {
        **qwen3,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": 8,  # transformers 4's key (5 writes num_local_experts)
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [3],
    }
    cfg = ModelConfig.from_dict(moe).moe
    assert cfg is not None and (cfg.num_experts, cfg.scoring, cfg.norm_topk_prob) == (8, "softmax", False)
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, False]


def test_gemma3_config_in_transformers_4_spelling() -> None:
    raw = {
        **BASE,
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "num_hidden_layers": 6,
        "head_dim": 16,
        "query_pre_attn_scalar": 256,
        "sliding_window": 512,
        "sliding_window_pattern": 3,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    }
    cfg = ModelConfig.from_dict(raw)
    assert cfg.layer_windows == (512, 512, None, 512, 512, None)
    local, full = (10_000.0, None), (1_000_000.0, {"rope_type": "linear", "factor": 8.0})
    assert cfg.gemma is not None and cfg.gemma.layer_rope == (local, local, full, local, local, full)
    assert cfg.gemma.query_pre_attn_scalar == 256 and cfg.gemma.final_logit_softcapping is None
    capped = ModelConfig.from_dict({**raw, "attn_logit_softcapping": 50.0}).gemma
    assert capped is not None and capped.attn_logit_softcapping == 50.0


def test_multimodal_gemma3_is_served_text_only(tiny_gemma3_mm, tmp_path) -> None:
    """Gemma3ForConditionalGeneration: the language model's weights under their text names, no
    vision tower; the text_config's gaps filled with Gemma3TextConfig's defaults (the hub's 4B
    config states only a few fields); a processor's chat_template.json serves as the template."""
    from engine.chat_template import load_chat_templates
    from engine.models.gemma import GemmaForCausalLM
    from engine.models.loader import load_weights

    renames = GemmaForCausalLM.WEIGHT_RENAMES["Gemma3ForConditionalGeneration"]
    loaded = load_weights(tiny_gemma3_mm, torch.float32, torch.device("cpu"), (), 2, renames)
    assert loaded and all(n.startswith("model.") for n in loaded)
    assert "model.layers.1.self_attn.q_norm.weight" in loaded and not [n for n in loaded if "vision" in n]

    hub_4b = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "eos_token_id": [1, 106],
        "text_config": {
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "model_type": "gemma3_text",
            "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
        "vision_config": {"hidden_size": 1152},
    }
    cfg = ModelConfig.from_dict(hub_4b)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (8, 4, 256, 262208)
    assert cfg.eos_token_ids == (1, 106) and cfg.tie_word_embeddings
    assert cfg.layer_windows == tuple(None if (i + 1) % 6 == 0 else 1024 for i in range(34))
    assert cfg.gemma is not None and cfg.gemma.layer_rope[5] == (
        1_000_000.0,
        {"factor": 8.0, "rope_type": "linear"},
    )
    assert cfg.gemma.layer_rope[0] == (10_000.0, None)

    (tmp_path / "chat_template.json").write_text(
        json.dumps({"chat_template": "{{ messages[0]['content'] }}"})
    )
    assert load_chat_templates(tmp_path, {}) == {"default": "{{ messages[0]['content'] }}"}
    assert load_chat_templates(tmp_path, {"chat_template": "tokenizer's"}) == {"default": "tokenizer's"}
