"""DeepSeek (MLA + MoE) through every engine path: latent KV cache, prefix hits, chunked prefill,
preemption, deterministic mode, checkpoint layouts. Tokens and logprobs against transformers (V3,
V3 with YaRN, V2, V2-Lite) are in test_correctness.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(tiny_deepseek, prompts) -> list[list[int]]:
    llm = LLM(str(tiny_deepseek), num_kv_blocks=256, enable_prefix_caching=False)
    return _tokens(llm.generate(prompts, GREEDY))


def test_cache_holds_one_latent_per_token(tiny_deepseek) -> None:
    llm = LLM(str(tiny_deepseek), num_kv_blocks=40, block_size=16)
    runner = llm.engine.model_runner
    mla = runner.model_config.mla
    assert (mla.kv_lora_rank, mla.qk_rope_head_dim) == (16, 8)
    assert len(runner.kv_caches) == 2
    assert all(len(parts) == 1 for parts in runner.kv_caches)
    assert runner.kv_caches[0][0].shape == (40, 16, 1, 24)
    # 2 layers x 16 tokens x 24 fp32 values; expanded per head it would be 2 x 16 x 4 x (24 + 16) x 4.
    assert runner.bytes_per_block == 2 * 16 * 24 * 4 == 3072
    assert runner.model_config.kv_layout == "latent:[block,token,1,dim]"


def test_prefix_cache_hit_gives_identical_tokens(tiny_deepseek, prompts, reference) -> None:
    llm = LLM(str(tiny_deepseek), num_kv_blocks=256)
    assert _tokens(llm.generate(prompts, GREEDY)) == reference
    again = llm.generate(prompts, GREEDY)
    assert _tokens(again) == reference
    assert [o.num_cached_tokens for o in again] == [((len(p) - 1) // 16) * 16 for p in prompts]


@pytest.mark.parametrize("budget", [7, 33])
def test_chunked_prefill_gives_identical_tokens(tiny_deepseek, prompts, reference, budget: int) -> None:
    llm = LLM(str(tiny_deepseek), num_kv_blocks=256, max_num_batched_tokens=budget)
    assert _tokens(llm.generate(prompts, GREEDY)) == reference


def test_preemption_recomputes_and_every_request_finishes(tiny_deepseek, prompts, reference) -> None:
    llm = LLM(str(tiny_deepseek), num_kv_blocks=30, max_num_batched_tokens=256)
    assert _tokens(llm.generate(prompts, GREEDY)) == reference
    assert llm.engine.stats().num_preemptions > 0
    llm.engine.block_manager.check_integrity()
    assert llm.engine.block_manager.num_used_blocks == 0


def test_deterministic_mode_is_exact_beside_others_and_after_a_prefix_hit(tiny_deepseek, prompts) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    llm = LLM(str(tiny_deepseek), deterministic=True, num_kv_blocks=256, max_num_batched_tokens=40)
    target = prompts[8]  # 160 tokens: chunked, then a prefix hit

    def logprobs(out) -> list[list[tuple[int, float]]]:
        return [sorted((t, lp.logprob) for t, lp in step.items()) for step in out.outputs[0].logprobs]

    alone = logprobs(llm.generate([target], params)[0])  # also fills the prefix cache
    beside = llm.generate([prompts[2], target, prompts[6]], params)
    assert beside[1].num_cached_tokens == 144
    assert logprobs(beside[1]) == alone  # bit for bit
    fresh = LLM(str(tiny_deepseek), deterministic=True, num_kv_blocks=256, max_num_batched_tokens=512)
    assert logprobs(fresh.generate([target], params)[0]) == alone  # unchunked


def test_experts_in_transformers_fused_layout_load_the_same(tiny_deepseek, tmp_path: Path, prompts) -> None:
    """A checkpoint holding ``experts.gate_up_proj`` / ``experts.down_proj`` as [E, ...] tensors
    (transformers' in-memory layout) serves the same tokens as one tensor per expert."""
    from safetensors.torch import load_file, save_file

    fused = tmp_path / "fused"
    shutil.copytree(tiny_deepseek, fused)
    weights = load_file(str(fused / "model.safetensors"))
    experts = json.loads((fused / "config.json").read_text())["n_routed_experts"]
    prefix = "model.layers.1.mlp.experts."
    gate_up = [
        torch.cat([weights.pop(f"{prefix}{e}.gate_proj.weight"), weights.pop(f"{prefix}{e}.up_proj.weight")])
        for e in range(experts)
    ]
    down = [weights.pop(f"{prefix}{e}.down_proj.weight") for e in range(experts)]
    weights[prefix + "gate_up_proj"] = torch.stack(gate_up)
    weights[prefix + "down_proj"] = torch.stack(down)
    save_file(weights, str(fused / "model.safetensors"))
    a = LLM(str(tiny_deepseek), num_kv_blocks=64).generate(prompts[:4], GREEDY)
    b = LLM(str(fused), num_kv_blocks=64).generate(prompts[:4], GREEDY)
    assert _tokens(a) == _tokens(b)


def test_deterministic_router_scores_do_not_depend_on_the_batch() -> None:
    """A sigmoid router's scores for a token are the same whatever number of tokens share its
    step (on CPU, ``torch.sigmoid`` over [T, 8] rounds some rows differently for some T)."""
    from engine.models.config import MoEConfig
    from engine.models.decoder import invariant_linear
    from engine.models.moe import MoE

    cfg = MoEConfig(
        num_experts=8,
        experts_per_token=8,  # every score is a weight: no rounding difference can hide
        num_shared_experts=0,
        intermediate_size=16,
        first_dense_layers=0,
        num_groups=1,
        topk_groups=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=False,
    )
    moe = MoE(cfg, invariant_linear, lambda x: x, deterministic=True)
    gen = torch.Generator().manual_seed(0)
    layer = {"router": torch.randn(8, 32, generator=gen), "router_bias": torch.zeros(8)}
    x = torch.randn(96, 32, generator=gen)
    weights, experts = moe.route(x, layer)
    for t in range(1, 97):
        w, e = moe.route(x[:t], layer)
        assert torch.equal(w[-1].sort().values, weights[t - 1].sort().values), t
