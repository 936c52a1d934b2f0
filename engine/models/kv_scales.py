"""Per-layer K/V scales of an fp8 KV cache, read from the checkpoint.

Checkpoints calibrated for an fp8 KV cache (AutoFP8 with ``kv_cache_quant_method``, llm-compressor's
``kv_cache_scheme``, compressed-tensors) store one scale per layer for the keys and one for the
values: ``model.layers.N.self_attn.k_scale`` / ``.v_scale``; older exports store one ``kv_scale``
for both, or ``k_proj.output_scale`` / ``v_proj.output_scale``. With an fp8 cache a layer's keys
are stored as ``k / k_scale`` rounded (saturating) to fp8 and read back as the stored value times
``k_scale``, the values likewise with ``v_scale``; MLA's single latent cache takes the layer's
``k_scale``, as vLLM's MLA backends do. With a cache in the model dtype (``auto``) the scales are
ignored, as vLLM ignores them, and a checkpoint without them scales by 1.0.

Every scale tensor (and the attention-input scales ``q_scale`` / ``prob_scale``, which ferry has no
use for: it attends in the model dtype) is popped from the weights here, so no model class sees
them. Only per-tensor scales load: per-head or per-channel ones are refused by name.
"""

from __future__ import annotations

import hashlib
import math
import re
import struct

import torch

KVScales = tuple[tuple[float, float], ...]  # per layer: (k_scale, v_scale)

# Tensor names the loader keeps in fp32 (a scale rounded to bf16 would be another scale).
SCALE_SUFFIXES = (
    "self_attn.k_scale",
    "self_attn.v_scale",
    "self_attn.kv_scale",
    "self_attn.q_scale",
    "self_attn.prob_scale",
    "k_proj.output_scale",
    "v_proj.output_scale",
)
_NAME = re.compile(
    r"model\.layers\.(\d+)\.self_attn\.(k_scale|v_scale|kv_scale|q_scale|prob_scale|[kv]_proj\.output_scale)"
)
# Which cache each stored scale is for; the others are dropped.
_TARGETS = {
    "kv_scale": (0, 1),
    "k_scale": (0,),
    "k_proj.output_scale": (0,),
    "v_scale": (1,),
    "v_proj.output_scale": (1,),
}


def take_kv_scales(weights: dict[str, torch.Tensor], num_layers: int, fp8_cache: bool) -> KVScales | None:
    """Pop every layer's scale tensors from ``weights``. Returns each layer's (k_scale, v_scale)
    (1.0 where the checkpoint has none) when the cache is fp8 and some scale is not 1; None
    otherwise: the cache then stores K/V as they are."""
    scales = [[1.0, 1.0] for _ in range(num_layers)]
    for name, match in [(n, m) for n in weights if (m := _NAME.fullmatch(n))]:
        tensor = weights.pop(name)
        layer, kind = int(match[1]), match[2]
        if kind not in _TARGETS or layer >= num_layers:
            continue
        if tensor.numel() != 1:
            raise ValueError(
                f"{name} holds {tensor.numel()} scales ({list(tensor.shape)}); only per-tensor KV cache "
                "scales are supported"
            )
        value = float(tensor.float())
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} = {value}: a KV cache scale must be a positive finite number")
        for part in _TARGETS[kind]:
            scales[layer][part] = value
    if not fp8_cache or all(s == [1.0, 1.0] for s in scales):
        return None
    return tuple((k, v) for k, v in scales)


def layer_scales(scales: KVScales | None, num_layers: int) -> KVScales:
    """What a model passes its attention per layer: the scales, or 1.0 everywhere."""
    return scales if scales is not None else ((1.0, 1.0),) * num_layers


def scales_digest(scales: KVScales) -> str:
    """A short stable digest of the scales: the KV tier's fingerprint separates caches written with
    other scales (the same K/V are other bytes)."""
    packed = b"".join(struct.pack("<dd", k, v) for k, v in scales)
    return hashlib.blake2b(packed, digest_size=8).hexdigest()
