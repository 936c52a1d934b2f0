"""Llama 4 text (``Llama4ForCausalLM``, and ``Llama4ForConditionalGeneration`` served text-only)
against transformers 5 on tiny fp32 checkpoints (``engine/demo_archs_llama4.py``): 4 layers, rope
layers attending in chunks of 8, a NoPE full layer with temperature tuning, qk norm, MoE layers with
input-scaled experts (top 1; and top 2) and a shared expert beside dense ones. Prompts of 17-64
tokens cross several chunks; chunked prefill runs over 4-token blocks.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

if not torch.cuda.is_available():  # never force the interpreter onto a real GPU run
    os.environ["TRITON_INTERPRET"] = "1"

from engine import LLM, SamplingParams  # noqa: E402
from engine.demo import build_model  # noqa: E402
from engine.demo_derived import build_lora_adapter  # noqa: E402
from engine.lora_request import LoRARequest  # noqa: E402
from engine.models.config import ModelConfig  # noqa: E402
from tests.engine.test_lora import merged_checkpoint  # noqa: E402

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
SHORT = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)  # bit-exactness checks


@pytest.fixture(scope="module")
def llama4_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llama4")
    return {arch: build_model(root / arch, arch) for arch in ("llama4", "llama4_top2", "llama4_mm")}


@pytest.fixture(scope="module")
def l4_prompts(prompts: list[list[int]]) -> list[list[int]]:
    return [prompts[i] for i in (0, 2, 4, 5, 6)]  # 1, 5, 17, 31 and 64 tokens


def _check(outs, path: Path, chosen: list[list[int]], hf_reference) -> None:  # noqa: ANN001
    """transformers' greedy tokens, and its logprobs within 1e-4."""
    for out, prompt in zip(outs, chosen, strict=True):
        ref_tokens, ref_logits = hf_reference(path, prompt, MAX_NEW)
        assert out.outputs[0].token_ids == ref_tokens
        ref_lp = torch.log_softmax(ref_logits, dim=-1)
        for step, (tok, entry) in enumerate(zip(ref_tokens, out.outputs[0].logprobs, strict=True)):
            assert abs(entry[tok].logprob - ref_lp[step, tok].item()) < 1e-4


def _rewrite(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**raw, **changes}))
    return dst


def test_config_reads_as_transformers_does(llama4_models) -> None:
    for arch in ("llama4", "llama4_mm"):
        cfg = ModelConfig.from_dir(llama4_models[arch])
        l4 = cfg.llama4
        assert cfg.num_layers == 4 and cfg.intermediate_size == 128 and cfg.head_dim == 16
        assert l4.rope_layers == (True, True, True, False)
        assert l4.layer_chunks == (8, 8, 8, None)
        assert l4.moe_layers == (False, True, False, True)
        assert l4.use_qk_norm and l4.temperature_tuning == (4.0, 0.1)
        assert (l4.num_experts, l4.experts_per_token, l4.intermediate_size_mlp) == (4, 1, 256)
        # A chunk is no window: the block manager never frees blocks of this model.
        assert cfg.layer_windows == (None,) * 4 and cfg.sliding_window is None
    top2 = ModelConfig.from_dir(llama4_models["llama4_top2"]).llama4
    assert top2.experts_per_token == 2


def test_bad_configs_are_refused_by_name(llama4_models, tmp_path) -> None:
    src = llama4_models["llama4"]
    cases = {
        "hidden_act": {"hidden_act": "gelu"},
        "layer_types": {"layer_types": ["sliding_attention"] * 4},
        "attention_chunk_size": {"attention_chunk_size": 0},
    }
    for field, change in cases.items():
        with pytest.raises(ValueError, match=field):
            ModelConfig.from_dir(_rewrite(src, tmp_path / field, **change))


def test_each_feature_changes_the_transformers_answer(llama4_models, l4_prompts, hf_model, tmp_path) -> None:
    """Without its chunks, temperature tuning or qk norm the same weights answer otherwise, so the
    matches below mean ferry computes each of them."""
    src, prompt = llama4_models["llama4"], torch.tensor([l4_prompts[-1]])
    with torch.no_grad():
        base = hf_model(src)(prompt).logits[0].log_softmax(-1)
        for name, change in {
            "chunk": {"attention_chunk_size": 64, "layer_types": None},
            "tuning": {"attn_temperature_tuning": False},
            "qk_norm": {"use_qk_norm": False},
        }.items():
            other = hf_model(_rewrite(src, tmp_path / name, **change))(prompt).logits[0].log_softmax(-1)
            assert (other - base).abs().max().item() > 1e-2, name


@pytest.mark.parametrize("arch", ["llama4", "llama4_top2", "llama4_mm"])
def test_greedy_matches_transformers_solo_and_batched(arch, llama4_models, l4_prompts, hf_reference) -> None:
    path = llama4_models[arch]
    llm = LLM(str(path), num_kv_blocks=128, max_num_batched_tokens=256)
    if arch == "llama4":  # the variants differ in their MLPs and weight names only: batched is enough
        _check([llm.generate([p], GREEDY)[0] for p in l4_prompts], path, l4_prompts, hf_reference)
    _check(llm.generate(l4_prompts, GREEDY), path, l4_prompts, hf_reference)
    llm.engine.block_manager.check_integrity()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_chunked_prefill_and_prefix_hits_match_transformers(backend, llama4_models, l4_prompts, hf_reference):
    """16-token prefill chunks over 4-token blocks (attention chunks of 8 start inside chunks and
    blocks), then a prompt sharing 40 tokens with the first, 36 of them from the prefix cache."""
    if backend == "triton":
        pytest.importorskip("triton", reason="triton is not installed (pip install 'ferry-serve[triton]')")
    path = llama4_models["llama4"]
    llm = LLM(
        str(path), attention_backend=backend, block_size=4, num_kv_blocks=128, max_num_batched_tokens=16
    )
    assert llm.engine.model_runner.model.attention.name == backend
    first, second = l4_prompts[-1], l4_prompts[-1][:40] + l4_prompts[3]
    for prompt, cached in ((first, 0), (second, 40)):
        out = llm.generate([prompt], GREEDY)[0]
        assert out.num_cached_tokens == cached
        _check([out], path, [prompt], hf_reference)
    if backend == "torch":  # the interpreted kernels are slow: one batch is enough of them
        _check(llm.generate(l4_prompts[1:4], GREEDY), path, l4_prompts[1:4], hf_reference)
    llm.engine.block_manager.check_integrity()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_deterministic_mode_is_exact_across_prefix_hits_and_batches(backend, llama4_models, l4_prompts):
    if backend == "triton":
        pytest.importorskip("triton", reason="triton is not installed (pip install 'ferry-serve[triton]')")
    path = llama4_models["llama4"]
    opts = dict(attention_backend=backend, block_size=4, num_kv_blocks=128, max_num_batched_tokens=16)
    llm = LLM(str(path), deterministic=True, **opts)
    prompt = l4_prompts[3]  # 31 tokens: 3 chunks of 8 and part of a fourth

    def logprobs(out) -> list[tuple[int, float]]:  # noqa: ANN001
        o = out.outputs[0]
        return [(t, lp[t].logprob) for t, lp in zip(o.token_ids, o.logprobs, strict=True)]

    alone = logprobs(llm.generate([prompt], SHORT)[0])
    again = logprobs(llm.generate([prompt], SHORT)[0])  # its blocks from the prefix cache
    batched = logprobs(llm.generate([l4_prompts[1], prompt, l4_prompts[2]], SHORT)[1])
    assert again == alone and batched == alone


def test_lora_adapter_matches_transformers_merged(llama4_models, l4_prompts, hf_reference, tmp_path) -> None:
    """An adapter on attention and on the dense layers' MLPs (``feed_forward``); the MoE layers' MLPs
    take none."""
    path = llama4_models["llama4"]
    adapter = build_lora_adapter(tmp_path / "adapter", path, seed=7, rank=8, alpha=32)
    keys = load_file(str(adapter / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.2.feed_forward.gate_proj.lora_A.weight" in keys
    assert not any("layers.1.feed_forward" in key for key in keys)  # an MoE layer
    merged = merged_checkpoint(path, adapter, tmp_path / "merged")
    llm = LLM(str(path), enable_lora=True, num_kv_blocks=128, max_num_batched_tokens=256)
    lora = LoRARequest("x", 1, str(adapter))
    chosen = l4_prompts[1:4]
    outs = llm.generate(chosen, GREEDY, lora_request=[lora, None, lora])
    _check([outs[0], outs[2]], merged, [chosen[0], chosen[2]], hf_reference)
    _check([outs[1]], path, [chosen[1]], hf_reference)


def test_dummy_weights_load(llama4_models) -> None:
    for arch in ("llama4", "llama4_mm"):
        llm = LLM(str(llama4_models[arch]), load_format="dummy", num_kv_blocks=32)
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))[0]
        assert len(out.outputs[0].token_ids) == 3
