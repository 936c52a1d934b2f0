"""Integer- and fp8-quantized checkpoints (GPTQ, AWQ, compressed-tensors, vLLM's per-tensor /
per-channel fp8) dequantized at load.

``quantization_config`` is read once into a frozen :class:`WeightQuant`; the loader hands each
quantized module's tensors (``<prefix>.qweight``, ``.scales``… or ``.weight_packed``,
``.weight_scale``…) to :func:`dequantize`, which returns the ``[out, in]`` float weight that the
model code then finds under ``<prefix>.weight``. Which modules are quantized comes from the tensor
names, so ``modules_to_not_convert`` / ``ignore`` layers and an unquantized ``lm_head`` load as
usual. There are no integer kernels here: weights are held and computed in the model dtype.

This module must never guess at a layout: a variant it does not know is refused by name when the
config is read, before any weight is touched. Reading the config (and refusing) is
``engine/models/quant_config.py``; this file turns a module's pieces into its float weight.
"""

from __future__ import annotations

import torch

from engine.models.quant_config import MXFP4_GROUP, WeightQuant
from engine.models.quant_config import from_config as from_config  # still importable from here

# The sixteen e2m1 values an MXFP4 nibble codes (layout: ``quant_config.py``'s ``_MXFP4_PARTS``).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# AWQ's GEMM layout packs output columns 8 to an int32 in this order (nibble i holds column ORDER[i]).
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def dequantize(
    prefix: str, parts: dict[str, torch.Tensor], quant: WeightQuant, dtype: torch.dtype = torch.float32
) -> torch.Tensor | None:
    """The fp32 ``[out, in]`` weight of module ``prefix`` from its quantized pieces; None when the
    pieces hold no weight (activation scales alone). MXFP4 experts come back in ``dtype`` (exact:
    each value is a 4-bit float times a power of two), in the unquantized checkpoint's layout."""
    if quant.method == "mxfp4":
        return dequantize_mxfp4(prefix, parts, dtype)
    if quant.method == "compressed-tensors":
        return _dequantize_ct(prefix, parts, quant)
    if quant.method == "fp8":
        return _dequantize_fp8_scaled(prefix, parts)
    if "qweight" not in parts:
        raise ValueError(f"{prefix}: {sorted(parts)} without {prefix}.qweight in the checkpoint")
    missing = [p for p in ("qzeros", "scales") if p not in parts]
    if missing:
        raise ValueError(f"{prefix}.qweight has no {prefix}.{missing[0]} in the checkpoint")
    scales = parts["scales"].float().T  # [out, groups]
    out = scales.shape[0]
    if quant.method == "gptq":
        q = unpack_int32(parts["qweight"], quant.bits, dim=0).T  # [out, in]
        zeros = unpack_int32(parts["qzeros"], quant.bits, dim=1)[:, :out].T + quant.zero_offset
    else:  # awq: packed along the output dimension, columns interleaved
        order = _awq_columns(parts["qweight"].shape[1] * 8)
        q = unpack_int32(parts["qweight"], 4, dim=1)[:, order].T
        zeros = unpack_int32(parts["qzeros"], 4, dim=1)[:, _awq_columns(parts["qzeros"].shape[1] * 8)].T
    cols = q.shape[1]
    if quant.desc_act:
        if "g_idx" not in parts:
            raise ValueError(f"{prefix}.qweight has no {prefix}.g_idx in the checkpoint (desc_act is true)")
        groups = parts["g_idx"].long()
    else:
        groups = torch.arange(cols) // (cols if quant.group_size == -1 else quant.group_size)
    _check_groups(prefix, groups, scales, q.shape)
    return _affine(q, scales, zeros[:out], groups)


def _holds_weight(prefix: str, parts: dict[str, torch.Tensor]) -> bool:
    """Whether a module's pieces hold a quantized weight (not activation scales alone)."""
    if "weight_packed" not in parts and "weight" not in parts:
        if "weight_scale" in parts:
            raise ValueError(f"{prefix}.weight_scale has no quantized weight in the checkpoint")
        return False
    if "weight_scale" not in parts:
        raise ValueError(f"{prefix} has no {prefix}.weight_scale in the checkpoint")
    return True


def _dequantize_fp8_scaled(prefix: str, parts: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """vLLM's fp8 format: the strategy follows the scale's size (one value: per tensor; one per
    output row, ``[out]`` or ``[out, 1]``: per channel), as compressed-tensors' float formats."""
    if not _holds_weight(prefix, parts):
        return None
    scale = parts["weight_scale"]
    strategy = "tensor" if scale.numel() == 1 else "channel"
    return _per_row(prefix, parts["weight"], scale.float().reshape(-1, 1), None, strategy)


def _dequantize_ct(prefix: str, parts: dict[str, torch.Tensor], quant: WeightQuant) -> torch.Tensor | None:
    if not _holds_weight(prefix, parts):
        return None
    ranks = [(s.match(prefix), -i) for i, s in enumerate(quant.schemes)]  # the first of equals wins
    best = max(range(len(ranks)), key=ranks.__getitem__)
    scheme = quant.schemes[best]
    if ranks[best][0] == 0:
        raise ValueError(f"{prefix} is quantized but matches no compressed-tensors config group's targets")
    scale = parts["weight_scale"].float()
    zero = parts.get("weight_zero_point")
    if "weight_packed" in parts:
        out, cols = (int(n) for n in parts["weight_shape"])
        q = unpack_int32(parts["weight_packed"], scheme.bits, dim=1)[:, :cols] - (1 << (scheme.bits - 1))
        if zero is not None and zero.dtype == torch.int32 and scheme.strategy in ("channel", "group"):
            zero = unpack_int32(zero, scheme.bits, dim=0)[:out] - (1 << (scheme.bits - 1))
    else:
        q = parts["weight"]
        out, cols = q.shape
    if scheme.strategy == "block":
        from engine.models.loader import dequantize_fp8

        return dequantize_fp8(q, scale, scheme.block or (128, 128))
    if scheme.strategy != "group":
        return _per_row(prefix, q, scale, zero, scheme.strategy)
    groups = (
        parts["weight_g_idx"].long() if "weight_g_idx" in parts else torch.arange(cols) // scheme.group_size
    )
    _check_groups(prefix, groups, scale, (out, cols))
    return _affine(q.float() if q.is_floating_point() else q, scale, zero, groups)


def _per_row(
    prefix: str, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, strategy: str
) -> torch.Tensor:
    """A ``[out, in]`` weight with one scale (and zero) for the whole tensor (``tensor``) or one
    per output row (``channel``: ``[out, 1]``)."""
    out, cols = q.shape[0], q.shape[-1]
    if strategy == "tensor":
        scale = scale.reshape(1, 1).expand(out, 1)
        zero = zero.reshape(1, 1).expand(out, 1) if zero is not None else None
    groups = torch.zeros(cols, dtype=torch.long)
    _check_groups(prefix, groups, scale, (out, cols))
    return _affine(q.float() if q.is_floating_point() else q, scale, zero, groups)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words holding ``32 // bits`` unsigned values each, lowest bits first, packed along
    ``dim`` (0: word ``r`` holds rows ``r * n …``; 1: word ``c`` holds columns ``c * n …``)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    mask = (1 << bits) - 1
    rows, cols = packed.shape
    if dim == 0:
        return ((packed[:, None, :] >> shifts[None, :, None]) & mask).reshape(rows * len(shifts), cols)
    return ((packed[:, :, None] >> shifts[None, None, :]) & mask).reshape(rows, cols * len(shifts))


def _awq_columns(n: int) -> torch.Tensor:
    """For each logical output column, the position its value unpacks to in AWQ's interleaved order."""
    inverse = sorted(range(8), key=lambda i: _AWQ_ORDER[i])  # column j sits in nibble inverse[j]
    return torch.tensor([8 * (j // 8) + inverse[j % 8] for j in range(n)])


def _check_groups(prefix: str, groups: torch.Tensor, scales: torch.Tensor, shape: tuple[int, int]) -> None:
    if scales.shape[0] != shape[0] or len(groups) != shape[1] or int(groups.max()) >= scales.shape[1]:
        raise ValueError(
            f"{prefix}: scales of shape {tuple(scales.shape)} do not fit a {shape[0]}x{shape[1]} weight"
            f" in {int(groups.max()) + 1} groups"
        )


def _affine(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, groups: torch.Tensor
) -> torch.Tensor:
    """``(q - zero) * scale`` in fp32, where column ``c`` of the ``[out, in]`` weight takes the scale
    and zero of group ``groups[c]`` (``scale`` and ``zero`` are ``[out, num_groups]``)."""
    if zero is not None:
        q = q.to(torch.int32) - zero.to(torch.int32)[:, groups]
    return q.float() * scale[:, groups]


def dequantize_mxfp4(prefix: str, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """gpt-oss's fused expert weight ``[E, in, out]`` (``gate_up_proj`` / ``down_proj``, as the
    unquantized checkpoints store it; a transposed view of the dequantized ``[E, out, in]``)."""
    missing = [p for p in ("blocks", "scales") if p not in parts]
    if missing:
        raise ValueError(f"{prefix}_{missing[0]} is missing from the MXFP4 checkpoint")
    blocks, scales = parts["blocks"], parts["scales"]
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != MXFP4_GROUP // 2:
        raise ValueError(
            f"{prefix}: MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)} "
            f"(expected [..., groups, {MXFP4_GROUP // 2}] and [..., groups])"
        )
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)  # [..., G, 16, 2]
    values = values.reshape(*scales.shape, MXFP4_GROUP)
    # ldexp in the target dtype, as transformers dequantizes: fp4 values times powers of two are exact.
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.reshape(*scales.shape[:-1], -1).transpose(-1, -2)
