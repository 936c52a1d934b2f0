"""The rotary cos/sin table, with the scaling variants applied when it is built (never per call)."""

from __future__ import annotations

import math
from typing import Any

import torch


def inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies as transformers computes them (fp32), scaled per ``rope_type``."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return freqs
    kind = scaling["rope_type"]
    if kind == "linear":
        return freqs / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / freqs
        scaled = torch.where(wavelen > low_wavelen, freqs / factor, freqs)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling, freqs)
    if kind == "dynamic" and scaling.get("alpha"):
        # Hunyuan's NTK-alpha: a fixed alpha stretches the base once (transformers: "ntk_alpha"), so the
        # table does not depend on the sequence length as dynamic NTK's does.
        base = theta * float(scaling["alpha"]) ** (head_dim / (head_dim - 2))
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    raise ValueError(
        f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3, yarn, longrope, "
        "dynamic with a fixed alpha)"
    )


def _yarn_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any], freqs: torch.Tensor) -> torch.Tensor:
    """YaRN: high frequencies kept, low ones interpolated by ``factor``, a linear ramp between the
    dimensions that turn ``beta_fast`` and ``beta_slow`` times over the original context."""
    factor = float(scaling["factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def dim_for(rotations: float) -> float:
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_for(beta_fast), dim_for(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (original frequency), 0: interpolate (divided by factor)
    # The same fp32 operations as transformers, so the tables agree bit for bit.
    interpolated = 1.0 / (
        factor * theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    )
    return interpolated * (1 - keep) + freqs * keep


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """What YaRN and longrope multiply cos and sin by (1 for every other rope type). Longrope's is
    resolved when the config is read (``config.py``: it needs ``max_position_embeddings``)."""
    if scaling is not None and scaling["rope_type"] == "longrope":
        return float(scaling["attention_factor"])
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all:
        return _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all))
    return _yarn_mscale(factor)


def softmax_scale_factor(scaling: dict[str, Any] | None) -> float:
    """DeepSeek's extra softmax scale under YaRN: ``mscale(factor, mscale_all_dim) ** 2``."""
    if scaling is None or scaling["rope_type"] == "default" or not scaling.get("mscale_all_dim"):
        return 1.0
    return _yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2


def build_cos_sin_cache(
    head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None, device: torch.device
) -> torch.Tensor:
    """fp32 ``[max_positions, head_dim]``: row p = concat(cos(p * f), sin(p * f)) over the D/2 freqs
    (times YaRN's or longrope's attention factor). Longrope's rows come from two sets of frequencies:
    see ``longrope_cache``."""
    if scaling is not None and scaling["rope_type"] == "longrope":
        return longrope_cache(head_dim, max_positions, theta, scaling).to(device)
    table = rope_rows(inv_freq(head_dim, theta, scaling), 0, max_positions, attention_factor(scaling))
    return table.to(device)


def rope_rows(freqs: torch.Tensor, start: int, stop: int, mscale: float = 1.0) -> torch.Tensor:
    """Rows ``start..stop-1`` of a cos/sin table over ``freqs``, times ``mscale`` (fp32 throughout, in
    transformers' order of operations, so the rows agree with its rotary bit for bit)."""
    angles = torch.arange(start, stop, dtype=torch.float32)[:, None] * freqs[None, :]
    table = torch.cat((angles.cos(), angles.sin()), dim=-1)
    if mscale != 1.0:
        table *= mscale
    return table


def longrope_inv_freq(rotary_dim: int, theta: float, factors: Any, field: str) -> torch.Tensor:
    """Longrope's frequencies: the plain ones divided, each, by its entry of ``factors`` (the
    scaling's ``field``: ``short_factor`` or ``long_factor``)."""
    if not isinstance(factors, list | tuple) or len(factors) != rotary_dim // 2:
        raise ValueError(f"rope_scaling {field} must list {rotary_dim // 2} numbers (got {factors!r})")
    shape = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (torch.tensor([float(f) for f in factors], dtype=torch.float32) * theta**shape)


def longrope_cache(
    rotary_dim: int, max_positions: int, theta: float, scaling: dict[str, Any]
) -> torch.Tensor:
    """Longrope (Phi-3 128k, Phi-3.5-mini, Phi-4-mini): rows below ``original_max_position_embeddings``
    from the short factors' frequencies, rows from there on from the long factors', all times the
    attention factor. transformers instead rotates a whole sequence with the long factors once it grows
    past the original length (its earlier positions included); a paged cache cannot re-rotate the keys
    it holds, so ferry picks per position as vLLM does. Below the original length both agree exactly."""
    original = int(scaling["original_max_position_embeddings"])
    mscale = attention_factor(scaling)
    short = longrope_inv_freq(rotary_dim, theta, scaling.get("short_factor"), "short_factor")
    long = longrope_inv_freq(rotary_dim, theta, scaling.get("long_factor"), "long_factor")
    split = min(original, max_positions)
    return torch.cat((rope_rows(short, 0, split, mscale), rope_rows(long, split, max_positions, mscale)))
