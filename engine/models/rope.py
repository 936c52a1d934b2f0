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
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")


def build_cos_sin_cache(
    head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None, device: torch.device
) -> torch.Tensor:
    """fp32 ``[max_positions, head_dim]``: row p = concat(cos(p * f), sin(p * f)) over the D/2 freqs."""
    f = inv_freq(head_dim, theta, scaling)
    pos = torch.arange(max_positions, dtype=torch.float32)
    angles = pos[:, None] * f[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).to(device)
