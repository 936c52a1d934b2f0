"""`kv_cache_dtype="fp8"` (vLLM's --kv-cache-dtype): the cache holds fp8 values (4x the blocks of an
fp32 cache in the same bytes), attention reads them widened back, results stay within fp8's
rounding of the full-precision cache's, and every path that moves blocks (prefix cache, the KV tier,
MLA latents, the Triton kernels) carries them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig

# Triton's kernels run in its interpreter on a machine without a GPU; set before triton is imported.
if not torch.cuda.is_available():  # never force the interpreter onto a real GPU run
    os.environ["TRITON_INTERPRET"] = "1"

PROMPT = [(11 * i + 5) % 900 + 10 for i in range(64)]
# Chunks of 16: each later chunk's prompt logprobs read the earlier chunks from the cache.
CHUNKED = {"num_threads": 1, "max_num_batched_tokens": 16, "block_size": 16}
TORCH = {"attention_backend": "torch"}  # on every device (auto is Triton on CUDA)


def _prompt_logprobs(llm: LLM, prompt: list[int] = PROMPT) -> torch.Tensor:
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    return torch.tensor([next(iter(e.values())).logprob for e in out.prompt_logprobs[1:]])


def test_an_fp8_cache_holds_more_blocks_in_the_same_bytes(tiny_llama: Path) -> None:
    budget = 1 << 20
    with LLM(str(tiny_llama), kv_cache_memory_bytes=budget, num_threads=1) as full:
        runner = full.engine.model_runner
        full_blocks, full_bytes = runner.num_kv_blocks, runner.bytes_per_block
        full_print = runner.model_fingerprint
    with LLM(str(tiny_llama), kv_cache_memory_bytes=budget, num_threads=1, kv_cache_dtype="fp8") as fp8:
        runner = fp8.engine.model_runner
        assert runner.kv_caches[0][0].dtype == torch.float8_e4m3fn  # the model itself stays fp32
        assert runner.bytes_per_block * 4 == full_bytes and runner.num_kv_blocks == 4 * full_blocks
        assert runner.model_fingerprint != full_print  # its blocks are never another cache's
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2"):
        EngineConfig(kv_cache_dtype="int8")


@pytest.mark.parametrize(("kv", "tolerance"), [("fp8", 0.05), ("fp8_e5m2", 0.1)])
def test_results_stay_within_fp8_rounding(tiny_llama: Path, kv: str, tolerance: float) -> None:
    """The torch backend's bounds (what ``auto`` picks on a CPU; on CUDA it would be Triton:
    test_kv_scales.py bounds those). Every read is of the rounded values, a first chunk's too."""
    with LLM(str(tiny_llama), num_kv_blocks=32, **CHUNKED, **TORCH) as llm:
        want = _prompt_logprobs(llm)
    with LLM(str(tiny_llama), num_kv_blocks=32, kv_cache_dtype=kv, **CHUNKED, **TORCH) as llm:
        got = _prompt_logprobs(llm)
    diff = (got - want).abs()
    assert diff[:15].max() > 0  # the first chunk reads its keys and values as the cache holds them
    assert diff.max() < tolerance


def test_cached_fp8_blocks_reproduce_the_first_answer(tiny_llama: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(str(tiny_llama), num_kv_blocks=32, kv_cache_dtype="fp8", num_threads=1) as llm:
        first = llm.generate([PROMPT], params)[0]
        again = llm.generate([PROMPT], params)[0]
        llm.engine.block_manager.check_integrity()
    assert again.num_cached_tokens == 48 and again.outputs[0].token_ids == first.outputs[0].token_ids


def test_fp8_blocks_cross_the_kv_tier(tiny_llama: Path) -> None:
    tier = "memory://fp8-kv"
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(str(tiny_llama), kv_tier=tier, num_kv_blocks=32, kv_cache_dtype="fp8", num_threads=1) as writer:
        cold = writer.generate([PROMPT], params)[0]
        assert writer.engine.connector.flush(10.0)
        with LLM(
            str(tiny_llama), kv_tier=tier, num_kv_blocks=32, kv_cache_dtype="fp8", num_threads=1
        ) as reader:
            warm = reader.generate([PROMPT], params)[0]
        with LLM(str(tiny_llama), kv_tier=tier, num_kv_blocks=32, num_threads=1) as other:
            full = other.generate([PROMPT], params)[0]
    assert warm.num_cached_tokens == 48 and warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert full.num_cached_tokens == 0  # a full-precision cache never reads fp8 blocks


def test_mla_latents_in_fp8(tiny_deepseek: Path) -> None:
    """The torch backend's bound, as above."""
    with LLM(str(tiny_deepseek), num_kv_blocks=32, **CHUNKED, **TORCH) as llm:
        want = _prompt_logprobs(llm)
    with LLM(str(tiny_deepseek), num_kv_blocks=32, kv_cache_dtype="fp8", **CHUNKED, **TORCH) as llm:
        assert llm.engine.model_runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
        got = _prompt_logprobs(llm)
    assert 0 < (got - want).abs().max() < 0.15


@pytest.mark.parametrize("model_fixture", ["tiny_llama", "tiny_deepseek"])
def test_an_fp8_prompt_reads_alike_however_it_is_chunked_or_cached(model_fixture: str, request) -> None:
    """A first chunk attends over its keys and values as the cache holds them, as later chunks,
    prefix hits and decode read them, so how a prompt was chunked or cached changes its logprobs
    by float32 summation order only, not by fp8's rounding (a first chunk attended over fresh
    full-precision values: greedy tokens changed with chunking or a prefix hit)."""
    path = request.getfixturevalue(model_fixture)
    opts = {"num_kv_blocks": 64, "kv_cache_dtype": "fp8", **TORCH}
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(str(path), **opts, **CHUNKED) as chunked:
        logprobs = _prompt_logprobs(chunked)
        chunked_tokens = chunked.generate([PROMPT], params)[0].outputs[0].token_ids
    with LLM(str(path), **opts, num_threads=1, block_size=16) as whole:
        assert (_prompt_logprobs(whole) - logprobs).abs().max() < 1e-4  # fp8 rounding: ~1e-2
        whole.engine.block_manager.reset_prefix_cache()
        first = whole.generate([PROMPT], params)[0]
        again = whole.generate([PROMPT], params)[0]  # 48 prompt tokens from the prefix cache
    assert again.num_cached_tokens == 48
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == chunked_tokens


def test_triton_kernels_read_fp8_caches(tiny_llama: Path, tiny_deepseek: Path) -> None:
    """The Triton kernels (attention, decode, MLA, the KV write) on fp8 caches stay within fp8's
    rounding of their own full-precision results. Unlike the torch backend's first chunk, they
    read every key from the cache, so even the first positions are rounded."""
    pytest.importorskip("triton")
    for model in (tiny_llama, tiny_deepseek):
        got = {}
        for kv in ("auto", "fp8"):
            opts = {"attention_backend": "triton", "kv_cache_dtype": kv, "num_kv_blocks": 32}
            with LLM(str(model), **opts, **CHUNKED) as llm:
                got[kv] = _prompt_logprobs(llm, PROMPT[:40])
        assert 0 < (got["fp8"] - got["auto"]).abs().max() < 0.1
