"""Phi-3.5-MoE (``PhimoeForCausalLM``) against transformers 5 on a tiny fp32 checkpoint
(``engine/demo_archs_llama4.py``'s "phimoe"): LayerNorms with bias, q/k/v/o and LM-head biases,
longrope (short factors, mscale 1.2; prompts run past its original 64 positions), a window of 24 on
every layer, and 4 experts behind sparsemixer with a threshold wide enough that its softmaxes weigh
several experts.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # never force the interpreter onto a real GPU run
    os.environ["TRITON_INTERPRET"] = "1"

from engine import LLM, SamplingParams  # noqa: E402
from engine.demo import build_model  # noqa: E402
from engine.demo_derived import build_lora_adapter  # noqa: E402
from engine.lora_request import LoRARequest  # noqa: E402
from engine.models.config import ModelConfig  # noqa: E402
from tests.engine.test_arch_llama4 import GREEDY, SHORT, _check, _rewrite  # noqa: E402
from tests.engine.test_lora import merged_checkpoint  # noqa: E402

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.fixture(scope="module")
def tiny_phimoe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("phimoe") / "m", "phimoe")


@pytest.fixture(scope="module")
def pm_prompts(prompts: list[list[int]]) -> list[list[int]]:
    return [prompts[i] for i in (0, 2, 4, 5, 6)]  # 1, 5, 17, 31 and 64 tokens


def test_config_reads_as_transformers_does(tiny_phimoe) -> None:
    cfg = ModelConfig.from_dir(tiny_phimoe)
    assert cfg.moe.num_experts == 4 and cfg.moe.intermediate_size == 128
    assert cfg.phimoe.jitter_eps == 0.2 and cfg.phimoe.mscale == 1.2
    assert cfg.phimoe.short_factor == tuple(1.0 + 0.1 * i for i in range(8))
    assert cfg.layer_windows == (24, 24) and cfg.attention_bias


def test_bad_configs_are_refused_by_name(tiny_phimoe, tmp_path) -> None:
    rope = ModelConfig.from_dir(tiny_phimoe).rope_scaling
    cases = {
        "long_mscale": {"rope_parameters": {**rope, "long_mscale": 1.5}},
        "rope_type": {"rope_parameters": {**rope, "rope_type": "linear", "factor": 2.0}},
        "short_factor": {"rope_parameters": {**rope, "short_factor": [1.0] * 3}},
        "hidden_act": {"hidden_act": "gelu"},
    }
    for field, change in cases.items():
        with pytest.raises(ValueError, match=field):
            LLM(str(_rewrite(tiny_phimoe, tmp_path / field, **change)), num_kv_blocks=16)


def test_each_feature_changes_the_transformers_answer(tiny_phimoe, pm_prompts, hf_model, tmp_path) -> None:
    """With another router threshold, mscale or window the same weights answer otherwise, so the
    matches below mean ferry computes each of them."""
    rope = ModelConfig.from_dir(tiny_phimoe).rope_scaling
    prompt = torch.tensor([pm_prompts[-1]])
    with torch.no_grad():
        base = hf_model(tiny_phimoe)(prompt).logits[0].log_softmax(-1)
        for name, change in {
            "jitter": {"router_jitter_noise": 0.01},
            "mscale": {"rope_parameters": {**rope, "short_mscale": 1.0, "long_mscale": 1.0}},
            "factors": {"rope_parameters": {**rope, "short_factor": [1.0] * 8}},
            "window": {"sliding_window": None},
        }.items():
            other = (
                hf_model(_rewrite(tiny_phimoe, tmp_path / name, **change))(prompt).logits[0].log_softmax(-1)
            )
            assert (other - base).abs().max().item() > 1e-2, name


def test_sparsemixer_weighs_several_experts(tiny_phimoe) -> None:
    """The router's weights are softmaxes over more than the one expert they pick (not all 1.0)."""
    llm = LLM(str(tiny_phimoe), num_kv_blocks=16)
    model = llm.engine.model_runner.model
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    weights, experts = model.moe.route(x, model.layers[0])
    assert experts.shape == (64, 2) and bool((experts[:, 0] != experts[:, 1]).all())
    assert bool((weights < 0.999).any()) and bool((weights > 0).all())


def test_greedy_matches_transformers_solo_and_batched(tiny_phimoe, pm_prompts, hf_reference) -> None:
    llm = LLM(str(tiny_phimoe), num_kv_blocks=128, max_num_batched_tokens=256)
    _check([llm.generate([p], GREEDY)[0] for p in pm_prompts], tiny_phimoe, pm_prompts, hf_reference)
    _check(llm.generate(pm_prompts, GREEDY), tiny_phimoe, pm_prompts, hf_reference)
    llm.engine.block_manager.check_integrity()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_chunked_prefill_and_prefix_hits_match_transformers(backend, tiny_phimoe, pm_prompts, hf_reference):
    """16-token chunks over 4-token blocks (the window of 24 leaves blocks behind), then a prompt
    sharing 40 tokens with the first, served from the prefix cache."""
    if backend == "triton":
        pytest.importorskip("triton", reason="triton is not installed (pip install 'ferry-serve[triton]')")
    opts = dict(attention_backend=backend, block_size=4, num_kv_blocks=128, max_num_batched_tokens=16)
    llm = LLM(str(tiny_phimoe), **opts)
    first, second = pm_prompts[-1], pm_prompts[-1][:40] + pm_prompts[3]
    for prompt, cached in ((first, 0), (second, 40)):
        out = llm.generate([prompt], GREEDY)[0]
        assert out.num_cached_tokens == cached
        _check([out], tiny_phimoe, [prompt], hf_reference)
    llm.engine.block_manager.check_integrity()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_deterministic_mode_is_exact_across_prefix_hits_and_batches(backend, tiny_phimoe, pm_prompts):
    if backend == "triton":
        pytest.importorskip("triton", reason="triton is not installed (pip install 'ferry-serve[triton]')")
    opts = dict(attention_backend=backend, block_size=4, num_kv_blocks=128, max_num_batched_tokens=16)
    llm = LLM(str(tiny_phimoe), deterministic=True, **opts)
    prompt = pm_prompts[3]

    def logprobs(out) -> list[tuple[int, float]]:  # noqa: ANN001
        o = out.outputs[0]
        return [(t, lp[t].logprob) for t, lp in zip(o.token_ids, o.logprobs, strict=True)]

    alone = logprobs(llm.generate([prompt], SHORT)[0])
    again = logprobs(llm.generate([prompt], SHORT)[0])
    batched = logprobs(llm.generate([pm_prompts[1], prompt, pm_prompts[2]], SHORT)[1])
    assert again == alone and batched == alone


def test_lora_adapter_on_attention_matches_transformers_merged(
    tiny_phimoe, pm_prompts, hf_reference, tmp_path
):
    adapter = build_lora_adapter(
        tmp_path / "adapter", tiny_phimoe, seed=7, rank=8, alpha=32, targets=ATTENTION
    )
    merged = merged_checkpoint(tiny_phimoe, adapter, tmp_path / "merged")
    llm = LLM(str(tiny_phimoe), enable_lora=True, num_kv_blocks=128, max_num_batched_tokens=256)
    lora = LoRARequest("x", 1, str(adapter))
    chosen = pm_prompts[1:4]
    outs = llm.generate(chosen, GREEDY, lora_request=[lora, None, lora])
    _check([outs[0], outs[2]], merged, [chosen[0], chosen[2]], hf_reference)
    _check([outs[1]], tiny_phimoe, [chosen[1]], hf_reference)


def test_dummy_weights_load(tiny_phimoe) -> None:
    llm = LLM(str(tiny_phimoe), load_format="dummy", num_kv_blocks=32)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 3
