"""GPT-NeoX, Phi, StableLM and GPT-J (engine/models/classic.py) against transformers 5 on the same tiny
fp32 checkpoints: greedy tokens equal and logprobs within 1e-4, solo and batched, in small chunks over
small blocks and behind a prefix-cache hit, on the Triton path, with LoRA where these models take it;
and their config.json read as transformers' config classes read them.
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
# Fixture name -> (engine.demo.build_model architecture, seed); engine/demo_archs_classic.py says
# what each tiny shape exercises.
CLASSIC = {
    "tiny_gpt_neox": ("gpt_neox", 60),  # parallel residual over two norms, biases, a quarter rotary
    "tiny_gpt_neox_seq": ("gpt_neox_seq", 61),  # sequential residual, no attention biases, gelu_new
    "tiny_phi": ("phi", 62),  # one norm, parallel blocks, GQA, q/k LayerNorm, head bias
    "tiny_stablelm": ("stablelm", 63),  # sequential, q/k/v biases, SwiGLU
    "tiny_stablelm_parallel": ("stablelm_parallel", 64),  # parallel on one norm, per-head q/k norm
    "tiny_gptj": ("gptj", 65),  # rotary over interleaved pairs of half of each head
}


tiny_model_fixtures(CLASSIC, globals())


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)


@pytest.mark.parametrize("model_fixture", list(CLASSIC))
def test_greedy_matches_transformers_solo_batched_chunked_and_cached(
    model_fixture: str, prompts, hf_reference, request
) -> None:
    check_solo_batched_chunked_cached(request.getfixturevalue(model_fixture), prompts, hf_reference, MAX_NEW)


@pytest.mark.parametrize(
    "model_fixture", ["tiny_gpt_neox", "tiny_phi", "tiny_stablelm_parallel", "tiny_gptj"]
)
def test_triton_path_matches_transformers(model_fixture: str, prompts, hf_reference, request) -> None:
    """Triton attention, KV writes and rotary (partial; GPT-J's permuted pairs) under the interpreter,
    chunked over blocks of 16."""
    check_triton_path(request.getfixturevalue(model_fixture), prompts, hf_reference)


@pytest.mark.parametrize("model_fixture", ["tiny_gpt_neox_seq", "tiny_phi"])
def test_deterministic_mode_is_exact_across_batches_and_matches_transformers(
    model_fixture: str, prompts, hf_reference, request
) -> None:
    """The batch-invariant linears (with biases) and attention: a request's logprobs are the same bits
    alone and beside others."""
    check_deterministic_solo_equals_batched(
        request.getfixturevalue(model_fixture), prompts, hf_reference, MAX_NEW
    )


@pytest.mark.parametrize(
    ("model_fixture", "targets"),
    [
        ("tiny_phi", ("q_proj", "k_proj", "v_proj", "dense")),  # dense: Phi's o_proj; fc1/fc2 take none
        ("tiny_stablelm", None),  # attention and the SwiGLU MLP
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


@pytest.mark.parametrize("model_fixture", ["tiny_gpt_neox", "tiny_gptj"])
def test_lora_is_refused_by_name_where_adapters_do_not_fit(model_fixture: str, request) -> None:
    path = request.getfixturevalue(model_fixture)
    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    with pytest.raises(ValueError, match=f"not supported for {arch}"):
        LLM(str(path), enable_lora=True, num_kv_blocks=16)


def test_dummy_weights_take_each_layout(
    tiny_gpt_neox: Path, tiny_phi: Path, tiny_stablelm_parallel: Path, tiny_gptj: Path, tmp_path: Path
) -> None:
    """``--load-format dummy`` names transformers' tensors as the loader renames a checkpoint's."""
    for src in (tiny_gpt_neox, tiny_phi, tiny_stablelm_parallel, tiny_gptj):
        bare = tmp_path / src.name
        shutil.copytree(src, bare, ignore=shutil.ignore_patterns("*.safetensors"))
        out = LLM(str(bare), load_format="dummy", num_kv_blocks=8).generate([[5, 6, 7]], GREEDY)
        assert len(out[0].outputs[0].token_ids) == MAX_NEW


def test_unsupported_activation_is_refused_by_name(tiny_phi: Path, tmp_path: Path) -> None:
    bad = tmp_path / "phi_mish"
    shutil.copytree(tiny_phi, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "hidden_act": "mish"}))
    with pytest.raises(ValueError, match="hidden_act 'mish'"):
        LLM(str(bad), num_kv_blocks=8)


SIZES = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}


@pytest.mark.parametrize(
    ("arch", "model_type", "raw"),
    [
        # Pythia's config.json: the rope under its old names.
        (
            "GPTNeoXForCausalLM",
            "gpt_neox",
            {**SIZES, "num_attention_heads": 4, "rotary_pct": 0.5, "rotary_emb_base": 5000},
        ),
        (
            "GPTNeoXForCausalLM",
            "gpt_neox",
            {**SIZES, "num_attention_heads": 4, "use_parallel_residual": False},
        ),
        ("PhiForCausalLM", "phi", {**SIZES, "num_attention_heads": 4}),
        ("PhiForCausalLM", "phi", {**SIZES, "num_attention_heads": 4, "partial_rotary_factor": 0.4}),
        ("StableLmForCausalLM", "stablelm", {**SIZES, "num_attention_heads": 4, "num_key_value_heads": 2}),
        # GPT-J keeps GPT-2's names; n_inner left out is four times n_embd.
        (
            "GPTJForCausalLM",
            "gptj",
            {"vocab_size": 100, "n_embd": 64, "n_head": 4, "n_layer": 2, "rotary_dim": 8},
        ),
    ],
)
def test_config_as_transformers_reads_it(arch: str, model_type: str, raw: dict) -> None:
    from transformers import AutoConfig

    ours = ModelConfig.from_dict({**raw, "architectures": [arch], "model_type": model_type})
    hf = AutoConfig.for_model(model_type, **raw)
    assert (ours.hidden_size, ours.num_layers, ours.num_heads) == (
        hf.hidden_size,
        hf.num_hidden_layers,
        hf.num_attention_heads,
    )
    assert ours.num_kv_heads == getattr(hf, "num_key_value_heads", hf.num_attention_heads)
    assert ours.intermediate_size == (
        hf.n_inner or 4 * hf.n_embd if model_type == "gptj" else hf.intermediate_size
    )
    assert ours.rms_norm_eps == getattr(hf, "layer_norm_eps", getattr(hf, "layer_norm_epsilon", None))
    assert ours.hidden_act == getattr(hf, "hidden_act", getattr(hf, "activation_function", None))
    assert ours.parallel_residual == getattr(hf, "use_parallel_residual", False)
    assert ours.max_position_embeddings == hf.max_position_embeddings
    assert ours.tie_word_embeddings == hf.tie_word_embeddings
    bias = {"gpt_neox": "attention_bias", "phi": None, "stablelm": "use_qkv_bias", "gptj": None}[model_type]
    assert ours.attention_bias == (getattr(hf, bias) if bias else model_type == "phi")
    if model_type == "gptj":  # rope base fixed at 10000; rotary_dim of the head's dims
        assert (ours.rope_theta, ours.rope_scaling) == (10000.0, None)
        assert int(ours.head_dim * ours.partial_rotary_factor) == hf.rotary_dim
    else:
        params = hf.rope_parameters
        assert (ours.rope_theta, ours.rope_scaling) == (params["rope_theta"], None)
        assert ours.partial_rotary_factor == params["partial_rotary_factor"]
