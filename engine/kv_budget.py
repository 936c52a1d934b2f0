"""How many bytes the KV cache gets when neither ``num_kv_blocks`` nor ``kv_cache_memory_bytes`` says.

On CUDA, as vLLM's ``--gpu-memory-utilization``: the engine may use ``utilization`` of the GPU's
memory in all; what the weights (and anything else already resident on the device, other
processes included) take comes off, and so does a reserve for one step's activations. What is
left holds KV blocks. The reserve is an estimate from the model's shapes and the step's token
budget, not a profiled forward pass: generous, with a fixed margin on top, so a full step fits
beside a full cache. If a step still runs out of memory, lower ``--gpu-memory-utilization`` or
set ``--kv-cache-memory-bytes``.

On CPU there is no device memory to share: 512 MiB unless told otherwise.
"""

from __future__ import annotations

from typing import Any

CPU_DEFAULT_BYTES = 512 * 1024 * 1024
ACTIVATION_MARGIN_BYTES = 512 * 1024 * 1024  # the allocator's fragmentation, CUDA graphs, cuBLAS workspaces
MIN_LOGIT_ROWS = 64  # prompt logprobs' chunks are never smaller


def logit_rows(config: Any) -> int:
    """Most rows of vocabulary-wide logits a step holds at once: each sequence's sampled position
    and its speculative drafts'. Prompt logprobs are computed in chunks of this many rows
    (``engine/postprocess.py``), so a long prompt's never take more."""
    spec = config.speculative_config
    drafts = spec.num_speculative_tokens if spec is not None else 0
    return max(config.max_num_seqs * (1 + drafts), MIN_LOGIT_ROWS)


def activation_reserve(
    *,
    max_num_batched_tokens: int,
    logit_rows: int,
    hidden_size: int,
    intermediate_size: int,
    vocab_size: int,
    num_heads: int,
    head_dim: int,
) -> int:
    """Bytes one step's activations may peak at (fp32 worst case): a few hidden-state copies, the
    MLP's gate/up output, the attention's q/k/v and output for every scheduled token, and fp32
    logits with the sampler's working copies for ``logit_rows`` rows (see ``logit_rows()``)."""
    tokens = max_num_batched_tokens
    per_token = 6 * hidden_size + 3 * intermediate_size + 4 * num_heads * head_dim
    logits = 4 * logit_rows * vocab_size
    return 4 * tokens * per_token + 4 * logits + ACTIVATION_MARGIN_BYTES


def kv_budget_bytes(total: int, free: int, utilization: float, reserve: int) -> int:
    """KV bytes on a GPU of ``total`` bytes with ``free`` still free after loading the weights: the
    engine's share (``utilization * total``) less what is already in use and the ``reserve``."""
    in_use = total - free
    return int(utilization * total) - in_use - reserve


def cuda_kv_bytes(config: Any, model: Any, block_bytes: int, free: int, total: int) -> tuple[int, int]:
    """``(KV bytes, activation reserve)`` for an engine ``config`` serving ``model`` (a
    ``ModelConfig``) on a GPU that reports ``free`` of ``total`` bytes after loading the weights.
    ValueError, saying why, when that leaves less than one KV block of ``block_bytes``."""
    inter = model.intermediate_size
    if model.moe is not None:  # each token's routed experts' gate/up rows
        inter = max(inter, model.moe.experts_per_token * model.moe.intermediate_size)
    reserve = activation_reserve(
        max_num_batched_tokens=config.max_num_batched_tokens,
        logit_rows=logit_rows(config),
        hidden_size=model.hidden_size,
        intermediate_size=inter,
        vocab_size=model.vocab_size,
        num_heads=model.num_heads,
        head_dim=model.head_dim,
    )
    budget = kv_budget_bytes(total, free, config.gpu_memory_utilization, reserve)
    if budget < block_bytes:
        gib = 2**30
        raise ValueError(
            f"gpu_memory_utilization={config.gpu_memory_utilization} leaves {max(budget, 0)} bytes for the "
            f"KV cache ({(total - free) / gib:.2f} GiB of {total / gib:.1f} GiB in use after loading the "
            f"weights, {reserve / gib:.2f} GiB reserved for activations): raise it, or set "
            "kv_cache_memory_bytes"
        )
    return budget, reserve
