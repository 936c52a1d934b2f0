"""ALiBi slopes (Press et al., "Train Short, Test Long"): one per query head, the rate at which a
head's score falls with the distance between query and key. Two rules exist in checkpoints, and
each model family must use its own, computed exactly as its reference does (in fp32), since a
slope off by one ulp moves every logit of a long prompt.
"""

from __future__ import annotations

import math

import torch


def bloom_alibi_slopes(n_heads: int) -> torch.Tensor:
    """Bloom's rule (transformers' ``build_alibi_tensor``): for the largest power of two ``p`` not
    above ``n_heads``, slopes ``b ** 1 .. b ** p`` with ``b = 2 ** (-8 / p)``; the heads beyond
    ``p`` take the odd powers of the rule for ``2p`` (``2 ** (-4 / p)``). fp32 [n_heads]."""
    p = 2 ** math.floor(math.log2(n_heads))
    base = torch.tensor(2 ** (-(2 ** -(math.log2(p) - 3))), dtype=torch.float32)
    slopes = torch.pow(base, torch.arange(1, 1 + p, dtype=torch.int32))
    if p != n_heads:
        extra = torch.tensor(2 ** (-(2 ** -(math.log2(2 * p) - 3))), dtype=torch.float32)
        odd = torch.arange(1, 1 + 2 * (n_heads - p), 2, dtype=torch.int32)
        slopes = torch.cat([slopes, torch.pow(extra, odd)])
    return slopes


def mpt_alibi_slopes(n_heads: int, bias_max: float = 8.0) -> torch.Tensor:
    """MPT's rule (``build_mpt_alibi_tensor``): for ``p``, the smallest power of two not below
    ``n_heads``, slopes ``2 ** -(i * bias_max / p)`` for i = 1..p; with fewer heads than ``p``, the
    odd-indexed slopes first, then the even ones, cut to ``n_heads``. fp32 [n_heads]."""
    p = 2 ** math.ceil(math.log2(n_heads))
    exponent = torch.arange(1, p + 1, dtype=torch.int64).float() * (bias_max / p)
    slopes = 1.0 / torch.pow(2, exponent)
    if p != n_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:n_heads]
    return slopes
