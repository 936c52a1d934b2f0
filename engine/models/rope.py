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
        f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3, yarn, "
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
    """What YaRN multiplies cos and sin by (1 for every other rope type)."""
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
    (times YaRN's attention factor)."""
    f = inv_freq(head_dim, theta, scaling)
    pos = torch.arange(max_positions, dtype=torch.float32)
    angles = pos[:, None] * f[None, :]
    table = torch.cat((angles.cos(), angles.sin()), dim=-1)
    mscale = attention_factor(scaling)
    if mscale != 1.0:
        table *= mscale
    return table.to(device)
