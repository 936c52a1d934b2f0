"""KV cache sizing (engine/kv_budget.py): on CUDA, what --gpu-memory-utilization leaves after the
weights and an activation reserve; on CPU, 512 MiB. The GPU branch's arithmetic is checked with the
numbers a GPU would report; the CPU default against the engine itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM
from engine.config import EngineConfig
from engine.kv_budget import (
    ACTIVATION_MARGIN_BYTES,
    CPU_DEFAULT_BYTES,
    MIN_LOGIT_ROWS,
    activation_reserve,
    cuda_kv_bytes,
    logit_rows,
)
from engine.models.config import ModelConfig

GIB = 1 << 30


def test_activation_reserve_counts_every_step_buffer() -> None:
    reserve = activation_reserve(
        max_num_batched_tokens=2048, logit_rows=64, hidden_size=4096, intermediate_size=14336,
        vocab_size=128256, num_heads=32, head_dim=128,
    )  # fmt: skip
    per_token = 6 * 4096 + 3 * 14336 + 4 * 32 * 128
    assert reserve == 4 * 2048 * per_token + 4 * 4 * 64 * 128256 + ACTIVATION_MARGIN_BYTES


def test_cuda_budget_is_the_share_less_what_is_in_use_and_the_reserve(tiny_llama: Path) -> None:
    model = ModelConfig.from_dir(tiny_llama)
    config = EngineConfig(gpu_memory_utilization=0.9)
    total, free = 80 * GIB, 60 * GIB  # 20 GiB in use after loading (weights, other processes)
    budget, reserve = cuda_kv_bytes(config, model, 4096, free, total)
    assert reserve == activation_reserve(
        max_num_batched_tokens=config.max_num_batched_tokens, logit_rows=config.max_num_seqs,
        hidden_size=model.hidden_size, intermediate_size=model.intermediate_size, vocab_size=model.vocab_size,
        num_heads=model.num_heads, head_dim=model.head_dim,
    )  # fmt: skip
    assert budget == int(0.9 * 80 * GIB) - 20 * GIB - reserve
    lower, _ = cuda_kv_bytes(EngineConfig(gpu_memory_utilization=0.5), model, 4096, free, total)
    assert lower == int(0.5 * 80 * GIB) - 20 * GIB - reserve
    with pytest.raises(
        ValueError,
        match="gpu_memory_utilization=0.2 leaves 0 bytes .* raise it, or set kv_cache_memory_bytes",
    ):
        cuda_kv_bytes(EngineConfig(gpu_memory_utilization=0.2), model, 4096, free, total)


def test_moe_reserve_counts_the_routed_experts_rows(tiny_qwen3_moe: Path) -> None:
    model = ModelConfig.from_dir(tiny_qwen3_moe)
    assert model.moe is not None
    config = EngineConfig()
    _, reserve = cuda_kv_bytes(config, model, 1, 70 * GIB, 80 * GIB)
    inter = max(model.intermediate_size, model.moe.experts_per_token * model.moe.intermediate_size)
    assert reserve == activation_reserve(
        max_num_batched_tokens=config.max_num_batched_tokens, logit_rows=config.max_num_seqs,
        hidden_size=model.hidden_size, intermediate_size=inter, vocab_size=model.vocab_size,
        num_heads=model.num_heads, head_dim=model.head_dim,
    )  # fmt: skip


def test_logit_rows_count_every_draft_and_bound_prompt_chunks(tiny_llama: Path) -> None:
    """Each sequence's sampled row and its drafts' rows: the reserve's logits grow with speculative
    decoding; never fewer than MIN_LOGIT_ROWS (prompt logprobs are computed in chunks of these)."""
    model = ModelConfig.from_dir(tiny_llama)
    plain = EngineConfig(max_num_seqs=128)
    spec = EngineConfig(max_num_seqs=128, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert (logit_rows(plain), logit_rows(spec)) == (128, 512)
    assert logit_rows(EngineConfig(max_num_seqs=2)) == MIN_LOGIT_ROWS
    _, without = cuda_kv_bytes(plain, model, 1, 70 * GIB, 80 * GIB)
    _, with_drafts = cuda_kv_bytes(spec, model, 1, 70 * GIB, 80 * GIB)
    assert with_drafts - without == 4 * 4 * (512 - 128) * model.vocab_size


def test_cpu_default_and_explicit_sizes(tiny_llama: Path) -> None:
    runner = LLM(str(tiny_llama)).engine.model_runner  # no size given: 512 MiB on CPU
    ceiling = runner.config.max_num_seqs * -(-runner.max_model_len // runner.block_size) * 2
    assert runner.num_kv_blocks == min(CPU_DEFAULT_BYTES // runner.bytes_per_block, ceiling)
    small = LLM(str(tiny_llama), kv_cache_memory_bytes=64 * 1024).engine.model_runner
    assert small.num_kv_blocks == 64 * 1024 // small.bytes_per_block


@pytest.mark.parametrize("value", [0, 0.0, 1.5, -0.1, True, "0.9"])
def test_utilization_out_of_range_is_refused(value) -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        EngineConfig(gpu_memory_utilization=value)
