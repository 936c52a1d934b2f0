"""Greedy tokens and logprobs against transformers on the tiny checkpoints (fp32)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

MAX_NEW = 12
MODELS = [
    "tiny_llama",
    "tiny_qwen2",
    "tiny_llama_tied",
    "tiny_llama3_rope",
    "tiny_llama_yarn",
    "tiny_qwen3",  # per-head q/k norm
    "tiny_qwen3_moe",  # softmax router, no shared experts, a dense layer
    "tiny_mixtral",  # Mistral + MoE, experts named w1/w2/w3
    "tiny_qwen2_moe",  # q/k/v bias + MoE with a gated shared expert
    "tiny_phi3",  # fused weights, partial rotary
    "tiny_gemma3",  # sandwich norms, local/global rope, soft-capped logits
    "tiny_gemma3_mm",  # the text model of a multimodal checkpoint
    "tiny_glm4_moe",  # bias, partial rotary, q/k norm, sigmoid router with correction bias
    "tiny_granite",  # embedding, attention, residual and logit multipliers
    "tiny_gemma2",  # soft-capped attention (explicit scores in the torch backend)
    "tiny_olmo2",  # post-block norms
    "tiny_gpt_oss",  # attention sinks, alternating windows, biased MoE with a clamped SwiGLU
    "tiny_deepseek",  # MLA + MoE (sigmoid router with correction bias, group-limited)
    "tiny_deepseek_yarn",
    "tiny_deepseek_v2",  # softmax router, group-limited
    "tiny_deepseek_v2_lite",  # no query compression, greedy router
    "tiny_seed_oss",  # q/k/v bias
    "tiny_olmo3",  # post-block norms, a sliding layer, a rope per layer type
    "tiny_smollm3",  # a NoPE layer
    "tiny_glm4",  # sandwich norms, partial rotary in interleaved pairs
    "tiny_ernie4_5",  # full rotary in interleaved pairs
    "tiny_ernie4_5_moe",  # softmax router with a correction bias, a shared expert
    "tiny_granitemoe",  # multipliers + MoE with experts stored as input_linear / output_linear
    "tiny_exaone4",  # post-block norms, per-head q/k norm, a window, a NoPE layer
    "tiny_hunyuan_dense",  # per-head q/k norm after rotary, NTK-alpha rope
    "tiny_minimax_m2",  # whole-projection q/k norm, partial rotary, sigmoid router with bias, w1/w2/w3
    "tiny_gemma",  # Gemma 1: Gemma's embedding scale, offset norms and GeGLU, Llama's two norms
    "tiny_arcee",  # ReLU^2 MLP
    "tiny_starcoder2",  # LayerNorms with bias, biased projections, GELU MLP, a window
    "tiny_cohere",  # parallel attention + MLP, per-head q/k LayerNorm, interleaved rotary, logit_scale
    "tiny_cohere2",  # + a sliding layer and a NoPE full one
    "tiny_apertus",  # xIELU MLP, per-head q/k norm
    "tiny_dots1",  # per-head q/k norm, sigmoid router with a bias, groups, unnormalised weights, a window
]


# Architectures whose layers differ (windows, NoPE layers, a rope per layer type), whose rotary or norms
# are their own, or whose MoE routing is: also run in small chunks over small blocks, and behind a prefix hit.
CHUNKED = [
    "tiny_seed_oss",
    "tiny_olmo3",
    "tiny_smollm3",
    "tiny_glm4",
    "tiny_ernie4_5_moe",
    "tiny_granitemoe",
    "tiny_exaone4",
    "tiny_hunyuan_dense",
    "tiny_minimax_m2",
    "tiny_gemma",
    "tiny_starcoder2",
    "tiny_cohere",
    "tiny_cohere2",
    "tiny_dots1",
]


@pytest.mark.parametrize("model_fixture", CHUNKED)
def test_chunked_prefill_and_prefix_hits_match_transformers(
    model_fixture: str, prompts, hf_reference, request
) -> None:
    """16-token chunks over 4-token blocks (the tiny windows of 8 cross both), then a prompt sharing
    40 tokens with the first, served from the prefix cache: transformers' tokens and logprobs."""
    path = request.getfixturevalue(model_fixture)
    llm = LLM(str(path), block_size=4, num_kv_blocks=128, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    first, second = prompts[6], prompts[6][:40] + prompts[5]  # 64 tokens; 40 of them + 31 others
    for prompt, cached in ((first, 0), (second, 40)):
        out = llm.generate([prompt], params)[0]
        assert out.num_cached_tokens == cached
        ref_tokens, ref_logits = hf_reference(path, prompt, 8)
        assert out.outputs[0].token_ids == ref_tokens
        ref_lp = torch.log_softmax(ref_logits, dim=-1)
        for step, (tok, entry) in enumerate(zip(ref_tokens, out.outputs[0].logprobs, strict=True)):
            assert abs(entry[tok].logprob - ref_lp[step, tok].item()) < 1e-4
    llm.engine.block_manager.check_integrity()


@pytest.mark.parametrize("model_fixture", MODELS)
def test_greedy_matches_transformers_solo_and_batched(
    model_fixture: str, prompts, hf_reference, request
) -> None:
    path = request.getfixturevalue(model_fixture)
    llm = LLM(str(path), num_kv_blocks=256, max_num_batched_tokens=512)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    refs = [hf_reference(path, p, MAX_NEW) for p in prompts]
    solo = [llm.generate([p], params)[0] for p in prompts]
    batched = llm.generate(prompts, params)
    for (ref_tokens, ref_logits), a, b in zip(refs, solo, batched, strict=True):
        assert a.outputs[0].token_ids == ref_tokens
        assert b.outputs[0].token_ids == ref_tokens
        assert a.outputs[0].finish_reason == "length"
        ref_lp = torch.log_softmax(ref_logits, dim=-1)
        for step, (tok, entry) in enumerate(zip(ref_tokens, b.outputs[0].logprobs, strict=True)):
            assert abs(entry[tok].logprob - ref_lp[step, tok].item()) < 1e-4
            assert entry[tok].rank == 1
    # A random model that repeats one token would hide most bugs.
    assert len({t for ref, _ in refs for t in ref}) > 5
    llm.engine.block_manager.check_integrity()
    assert llm.engine.block_manager.num_used_blocks == 0


def test_bfloat16_weights_load_and_agree_with_fp32(tiny_llama, prompts, hf_reference) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    bf = LLM(str(tiny_llama), dtype="bfloat16", num_kv_blocks=64)
    assert bf.engine.model_runner.kv_caches[0][0].dtype == torch.bfloat16
    out = bf.generate(prompts[3], params)[0]
    assert len(out.outputs[0].token_ids) == 4
    ref, _ = hf_reference(tiny_llama, prompts[3], 4)
    # bf16 rounding may flip late tokens of a random model, but the first one is robust here.
    assert out.outputs[0].token_ids[0] == ref[0]


def test_soft_capped_attention_in_deterministic_mode(tiny_gemma2, prompts, hf_reference) -> None:
    """Gemma 2's capped scores through the batch-invariant attention path as well."""
    llm = LLM(str(tiny_gemma2), deterministic=True, num_kv_blocks=256, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    for out, prompt in zip(llm.generate(prompts[4:8], params), prompts[4:8], strict=True):
        ref_tokens, ref_logits = hf_reference(tiny_gemma2, prompt, MAX_NEW)
        assert out.outputs[0].token_ids == ref_tokens
        ref_lp = torch.log_softmax(ref_logits, dim=-1)
        for step, (tok, entry) in enumerate(zip(ref_tokens, out.outputs[0].logprobs, strict=True)):
            assert abs(entry[tok].logprob - ref_lp[step, tok].item()) < 1e-4
