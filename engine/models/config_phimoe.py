"""What Phi-3.5-MoE (``PhimoeForCausalLM``) adds to ``ModelConfig``, read as transformers 5 reads it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PhimoeConfig:
    """``jitter_eps``: sparsemixer's masking threshold (``router_jitter_noise``); ``mscale``: what
    longrope multiplies cos and sin by (1.0 without longrope); ``short_factor``: longrope's per-frequency
    divisors (empty without longrope)."""

    jitter_eps: float
    mscale: float = 1.0
    short_factor: tuple[float, ...] = ()


def phimoe(raw: dict[str, Any], scaling: dict[str, Any] | None, rotary_dim: int) -> PhimoeConfig | None:
    """Phi-3.5-MoE's router and rope settings. transformers 5's ``PhimoeRotaryEmbedding`` builds its
    frequencies from ``short_factor`` at every length and multiplies cos/sin by ``long_mscale`` when the
    forward call's largest position passes ``original_max_position_embeddings``, else by ``short_mscale``:
    a factor that would depend on what else shares a call unless the two are equal (they are in the
    released checkpoint), so unequal ones are refused."""
    if raw.get("model_type") != "phimoe":
        return None
    jitter = float(raw.get("router_jitter_noise", 0.01))
    if scaling is None:
        return PhimoeConfig(jitter)
    if scaling["rope_type"] != "longrope":
        raise ValueError(f"Phi-3.5-MoE with rope_type {scaling['rope_type']!r} is not supported (longrope)")
    short, long = scaling.get("short_mscale"), scaling.get("long_mscale")
    if short is None or long is None or float(short) != float(long):
        raise ValueError(
            f"rope_scaling short_mscale ({short}) and long_mscale ({long}) must be equal numbers: "
            "transformers picks one per forward call by its longest position"
        )
    factors = tuple(float(f) for f in scaling["short_factor"])
    if len(factors) != rotary_dim // 2:
        raise ValueError(f"rope_scaling short_factor has {len(factors)} entries, not {rotary_dim // 2}")
    return PhimoeConfig(jitter, float(short), factors)
