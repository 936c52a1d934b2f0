"""OLMo 1, GLM-4-9B, Helium, Ministral, Ministral 3 and Falcon against transformers 5 on the same tiny
fp32 checkpoints: greedy tokens equal and logprobs within 1e-4, solo and batched, in small chunks over
small blocks and behind a prefix-cache hit, on the Triton path, with LoRA where these models take it;
their config.json read as transformers' config classes read them, and what ferry cannot serve
(Falcon's ALiBi) refused by name.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # never force the interpreter onto a real GPU run
    os.environ["TRITON_INTERPRET"] = "1"

from engine import LLM, LoRARequest, SamplingParams  # noqa: E402
from engine.demo import build_lora_adapter  # noqa: E402
from engine.models.config import ModelConfig  # noqa: E402
from tests.engine.arch_checks import (  # noqa: E402
    assert_matches,
    check_deterministic_solo_equals_batched,
    check_solo_batched_chunked_cached,
    check_triton_path,
    tiny_model_fixtures,
)
from tests.engine.test_lora import merged_checkpoint  # noqa: E402

MAX_NEW = 10
# Fixture name -> (engine.demo.build_model architecture, seed); engine/demo_archs_variants.py says
# what each tiny shape exercises.
VARIANTS = {
    "tiny_olmo1": ("olmo", 70),
    "tiny_glm": ("glm", 71),
    "tiny_helium": ("helium", 72),
    "tiny_ministral": ("ministral", 73),
    "tiny_ministral3": ("ministral3", 74),
    "tiny_falcon": ("falcon", 75),
    "tiny_falcon_mq": ("falcon_mq", 76),
    "tiny_falcon_seq": ("falcon_seq", 77),
    "tiny_falcon_one_norm": ("falcon_one_norm", 78),
}


tiny_model_fixtures(VARIANTS, globals())


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)


@pytest.mark.parametrize("model_fixture", list(VARIANTS))
def test_greedy_matches_transformers_solo_batched_chunked_and_cached(
    model_fixture: str, prompts, hf_reference, request
) -> None:
    check_solo_batched_chunked_cached(request.getfixturevalue(model_fixture), prompts, hf_reference, MAX_NEW)


@pytest.mark.parametrize("model_fixture", ["tiny_olmo1", "tiny_glm", "tiny_ministral3", "tiny_falcon"])
def test_triton_path_matches_transformers(model_fixture: str, prompts, hf_reference, request) -> None:
    """Triton attention, KV writes and rotary (GLM's interleaved half heads; Ministral 3's scaled
    queries past position 8 and window) under the interpreter, chunked over blocks of 16."""
    check_triton_path(request.getfixturevalue(model_fixture), prompts, hf_reference)


@pytest.mark.parametrize("model_fixture", ["tiny_olmo1", "tiny_ministral3", "tiny_falcon_mq"])
def test_deterministic_mode_is_exact_across_batches_and_matches_transformers(
    model_fixture: str, prompts, hf_reference, request
) -> None:
    """The batch-invariant linears, clamps and query scales: a request's logprobs are the same bits
    alone and beside others."""
    check_deterministic_solo_equals_batched(
        request.getfixturevalue(model_fixture), prompts, hf_reference, MAX_NEW
    )


@pytest.mark.parametrize(
    ("model_fixture", "targets"),
    [
        ("tiny_olmo1", None),  # attention (biased, clamped after the update) and the SwiGLU MLP
        ("tiny_glm", ("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj")),
    ],
)
def test_adapter_matches_transformers_merged(
    model_fixture: str, targets, prompts, hf_reference, request, tmp_path
) -> None:
    path = request.getfixturevalue(model_fixture)
    kwargs = {} if targets is None else {"targets": targets}
    adapter = build_lora_adapter(tmp_path / "adapter", path, seed=7, rank=8, alpha=32, **kwargs)
    merged = merged_checkpoint(path, adapter, tmp_path / "merged")
    llm = LLM(str(path), enable_lora=True, num_kv_blocks=128, max_num_batched_tokens=512)
    lora = LoRARequest("x", 1, str(adapter))
    chosen = [prompts[i] for i in (2, 3, 4, 5)]
    loras = [lora, None, lora, None]  # the adapter and the base model in one batch
    outs = llm.generate(chosen, GREEDY, lora_request=loras)
    changed = 0
    for prompt, out, used in zip(chosen, outs, loras, strict=True):
        ref = hf_reference(merged if used else path, prompt, MAX_NEW)
        assert_matches(out, *ref)
        changed += used is not None and ref[0] != hf_reference(path, prompt, MAX_NEW)[0]
    assert changed == 2  # the adapter changed what the model says


def test_lora_is_refused_by_name_for_falcon(tiny_falcon: Path) -> None:
    with pytest.raises(ValueError, match="not supported for FalconForCausalLM"):
        LLM(str(tiny_falcon), enable_lora=True, num_kv_blocks=16)


def test_dummy_weights_take_each_layout(
    tiny_olmo1: Path, tiny_glm: Path, tiny_ministral3: Path, tiny_falcon: Path, tiny_falcon_mq: Path, tmp_path
) -> None:
    """``--load-format dummy`` names transformers' tensors as the loader renames a checkpoint's."""
    for src in (tiny_olmo1, tiny_glm, tiny_ministral3, tiny_falcon, tiny_falcon_mq):
        bare = tmp_path / src.name
        shutil.copytree(src, bare, ignore=shutil.ignore_patterns("*.safetensors"))
        out = LLM(str(bare), load_format="dummy", num_kv_blocks=8).generate([[5, 6, 7]], GREEDY)
        assert len(out[0].outputs[0].token_ids) == MAX_NEW


@pytest.mark.parametrize(
    ("change", "field"),
    [({"alibi": True}, "alibi=true"), ({"parallel_attn": False}, "parallel_attn=false")],
)
def test_falcon_configs_ferry_cannot_serve_are_refused_by_name(
    tiny_falcon: Path, tmp_path: Path, change: dict, field: str
) -> None:
    bad = tmp_path / "falcon_bad"
    shutil.copytree(tiny_falcon, bad)
    config = json.loads((bad / "config.json").read_text())  # the new architecture
    (bad / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=field):
        LLM(str(bad), num_kv_blocks=8)


SIZES = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
FALCON = {"vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}


@pytest.mark.parametrize(
    ("arch", "model_type", "raw"),
    [
        ("OlmoForCausalLM", "olmo", {**SIZES, "num_attention_heads": 4, "clip_qkv": 2.0}),
        ("OlmoForCausalLM", "olmo", {**SIZES, "num_attention_heads": 4, "rms_norm_eps": 1e-3}),
        ("GlmForCausalLM", "glm", {**SIZES, "num_attention_heads": 4}),  # head_dim 128, 2 KV heads
        ("GlmForCausalLM", "glm", {**SIZES, "num_attention_heads": 4, "partial_rotary_factor": 1.0}),
        ("HeliumForCausalLM", "helium", {**SIZES, "num_attention_heads": 4}),  # head_dim 128, 20 KV heads
        ("MinistralForCausalLM", "ministral", {**SIZES, "num_attention_heads": 4, "head_dim": 16}),
        (
            "MinistralForCausalLM",
            "ministral",
            {**SIZES, "num_attention_heads": 4, "sliding_window": 32, "layer_types": ["full_attention"] * 2},
        ),
        ("MinistralForCausalLM", "ministral", {**SIZES, "num_attention_heads": 4, "sliding_window": None}),
        ("Ministral3ForCausalLM", "ministral3", {**SIZES, "num_attention_heads": 4}),  # YaRN + beta
        ("Ministral3ForCausalLM", "ministral3", {**SIZES, "num_attention_heads": 4, "sliding_window": 64}),
        ("FalconForCausalLM", "falcon", FALCON),  # multi-query, parallel, one norm
        ("FalconForCausalLM", "falcon", {**FALCON, "new_decoder_architecture": True, "num_kv_heads": 2}),
        ("FalconForCausalLM", "falcon", {**FALCON, "multi_query": False, "ffn_hidden_size": 96}),
    ],
)
def test_config_as_transformers_reads_it(arch: str, model_type: str, raw: dict) -> None:
    from transformers import AutoConfig

    ours = ModelConfig.from_dict({**raw, "architectures": [arch], "model_type": model_type})
    hf = AutoConfig.for_model(model_type, **raw)
    assert (ours.hidden_size, ours.num_layers, ours.num_heads, ours.vocab_size) == (
        hf.hidden_size,
        hf.num_hidden_layers,
        hf.num_attention_heads,
        hf.vocab_size,
    )
    assert ours.num_kv_heads == hf.num_key_value_heads
    assert ours.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    assert ours.max_position_embeddings == hf.max_position_embeddings
    assert ours.tie_word_embeddings == hf.tie_word_embeddings
    params = hf.rope_parameters
    assert ours.rope_theta == params["rope_theta"]
    assert ours.partial_rotary_factor == params.get("partial_rotary_factor", 1.0)
    if model_type == "falcon":
        assert ours.intermediate_size == hf.ffn_hidden_size
        assert ours.rms_norm_eps == hf.layer_norm_epsilon
        assert ours.parallel_residual == hf.parallel_attn
        return
    assert ours.intermediate_size == hf.intermediate_size
    assert ours.rms_norm_eps == (1e-5 if model_type == "olmo" else hf.rms_norm_eps)  # OLMo's is fixed
    assert ours.rope_interleave == (model_type in ("glm", "helium"))
    assert ours.clip_qkv == getattr(hf, "clip_qkv", None)
    if model_type == "ministral3":
        assert ours.rope_scaling is not None and ours.rope_scaling["rope_type"] == params["rope_type"]
        assert ours.rope_scaling["factor"] == params["factor"]
        beta, original = params["llama_4_scaling_beta"], params["original_max_position_embeddings"]
        assert ours.query_position_scale == (beta, original)
        assert ours.layer_windows == (hf.sliding_window,) * 2
    else:
        assert ours.rope_scaling is None and ours.query_position_scale is None
    if model_type == "ministral":
        window = hf.sliding_window
        assert ours.layer_windows == tuple(
            window if t == "sliding_attention" and window else None for t in hf.layer_types
        )
