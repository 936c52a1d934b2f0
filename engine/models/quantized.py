"""Integer- and fp8-quantized checkpoints (GPTQ, AWQ, compressed-tensors, vLLM's per-tensor /
per-channel fp8) dequantized at load.

``quantization_config`` is read once into a frozen :class:`WeightQuant`; the loader hands each
quantized module's tensors (``<prefix>.qweight``, ``.scales``… or ``.weight_packed``,
``.weight_scale``…) to :func:`dequantize`, which returns the ``[out, in]`` float weight that the
model code then finds under ``<prefix>.weight``. Which modules are quantized comes from the tensor
names, so ``modules_to_not_convert`` / ``ignore`` layers and an unquantized ``lm_head`` load as
usual. There are no integer kernels here: weights are held and computed in the model dtype.

This module must never guess at a layout: a variant it does not know is refused by name when the
config is read, before any weight is touched.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

# MXFP4 (gpt-oss experts): ``<name>_blocks`` uint8 [E, out, in/32, 16], two 4-bit floats (e2m1) a
# byte, the low nibble first; ``<name>_scales`` uint8 [E, out, in/32], one power of two (e8m0, bias
# 127) per 32 values along the input dimension.
_MXFP4_PARTS = ("_blocks", "_scales")
MXFP4_GROUP = 32
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# GPTQ / AWQ tensors of one module (``<prefix>.<part>``).
_PACKED_PARTS = ("qweight", "qzeros", "scales", "g_idx")
# compressed-tensors: pack-quantized stores ``weight_packed``; the naive formats (and vLLM's fp8)
# store ``weight`` in int8 / fp8 (recognised by its dtype). Activation scales are read and dropped
# (see WeightQuant).
_CT_PARTS = (
    "weight_packed",
    "weight_scale",
    "weight_zero_point",
    "weight_shape",
    "weight_g_idx",
    "input_scale",
    "input_zero_point",
)
_QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
_CT_FORMATS = ("pack-quantized", "naive-quantized", "int-quantized", "float-quantized")
_CT_STRATEGIES = ("tensor", "channel", "group", "block")
# AWQ's GEMM layout packs output columns 8 to an int32 in this order (nibble i holds column ORDER[i]).
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(frozen=True)
class CTScheme:
    """One compressed-tensors ``config_groups`` entry: its module targets and weight arguments."""

    targets: tuple[str, ...]  # class names ("Linear"), "re:<regex>" or module names
    format: str
    type: str  # int | float
    bits: int
    strategy: str  # tensor | channel | group | block
    group_size: int | None
    symmetric: bool
    block: tuple[int, int] | None

    def match(self, prefix: str) -> int:
        """How closely a target names module ``prefix``, as compressed-tensors ranks them: 3 by its
        name, 2 by a regex, 1 by its class (every quantized module here is a Linear), 0 not at all."""
        ranks = [0]
        for target in self.targets:
            if target.startswith("re:"):
                ranks.append(2 if re.match(target[3:], prefix) else 0)
            elif target == "Linear":
                ranks.append(1)
            else:
                ranks.append(3 if prefix == target or prefix.endswith("." + target) else 0)
        return max(ranks)


@dataclass(frozen=True)
class WeightQuant:
    """How the checkpoint stores its quantized linear weights.

    compressed-tensors schemes that also quantize activations (W8A8) are served with the weights
    dequantized and activations left in the model dtype: nothing rounds them as the quantizer did.
    """

    method: str  # gptq | awq | compressed-tensors | fp8 (per tensor / channel) | mxfp4
    bits: int = 4
    group_size: int = -1  # -1: one group spans the whole input dimension
    desc_act: bool = False  # GPTQ: ``g_idx`` names each input row's group
    zero_offset: int = 0  # GPTQ v1 checkpoints store zero - 1
    schemes: tuple[CTScheme, ...] = ()

    def holds(self, name: str, tensor: torch.Tensor) -> bool:
        """Whether this tensor is a piece of a quantized module (the loader collects those)."""
        if self.method == "mxfp4":
            return name.endswith(_MXFP4_PARTS) and tensor.dtype == torch.uint8
        part = name.rsplit(".", 1)[-1]
        if self.method not in ("compressed-tensors", "fp8"):
            return part in _PACKED_PARTS
        return part in _CT_PARTS or (part == "weight" and tensor.dtype in _QUANTIZED_DTYPES)

    def split(self, name: str) -> tuple[str, str]:
        """A piece's (module prefix, part): ``x.qweight`` -> (``x``, ``qweight``); MXFP4's
        ``x.gate_up_proj_blocks`` -> (``x.gate_up_proj``, ``blocks``)."""
        if self.method == "mxfp4":
            prefix, part = name.rsplit("_", 1)
            return prefix, part
        prefix, part = name.rsplit(".", 1)
        return prefix, part

    def weight_name(self, prefix: str) -> str:
        """The dequantized weight's name: ``<prefix>.weight``; for MXFP4 experts the unquantized
        checkpoint's name (``….experts.gate_up_proj``)."""
        return prefix if self.method == "mxfp4" else prefix + ".weight"


def from_config(quant: dict[str, Any]) -> WeightQuant | None:
    """The :class:`WeightQuant` of a GPTQ / AWQ / compressed-tensors / MXFP4 / per-tensor or
    per-channel fp8 config; None for other methods (block-wise fp8 is the loader's ``fp8_block``).
    Unsupported variants raise ValueError naming them."""
    method = quant.get("quant_method")
    if method == "fp8" and quant.get("weight_block_size") is None:
        return _fp8(quant)
    if method == "mxfp4":
        return WeightQuant(method="mxfp4", bits=4, group_size=MXFP4_GROUP)
    if method == "gptq":
        return _gptq(quant)
    if method == "awq":
        return _awq(quant)
    if method == "compressed-tensors":
        return _compressed_tensors(quant)
    return None


def check_quantization(requested: str | None, actual: str | None) -> None:
    """vLLM's check of ``--quantization``: the checkpoint (``actual``: its quant_method, None when
    unquantized) must be quantized with the method named (``gptq_marlin`` / ``awq_marlin`` name GPTQ
    / AWQ checkpoints). ferry never quantizes weights itself: a method asked of an unquantized
    checkpoint is refused by name."""
    from engine.config import QUANTIZATION_METHODS

    if requested is None or QUANTIZATION_METHODS[requested] == actual:
        return
    if actual is None and requested == "fp8":
        raise ValueError(
            "--quantization fp8 on an unquantized checkpoint asks for vLLM's online fp8 quantization, "
            "which ferry does not do; serve an fp8 checkpoint (block-wise or compressed-tensors) or leave "
            "out --quantization"
        )
    if actual is None:
        raise ValueError(
            f"--quantization {requested}: the checkpoint is not quantized (its config.json has no "
            "quantization_config) and ferry does not quantize weights itself"
        )
    raise ValueError(
        f"--quantization {requested} does not match the checkpoint, quantized with "
        f"quantization_config.quant_method={actual!r}; pass --quantization {actual} or leave it out"
    )


def _refuse(what: str) -> ValueError:
    return ValueError(f"quantized checkpoints are not supported ({what})")


def _gptq(quant: dict[str, Any]) -> WeightQuant:
    bits = int(quant.get("bits", 4))
    if bits not in (2, 4, 8):
        raise _refuse(f"GPTQ bits={bits}; 2, 4 and 8 bits load")
    fmt = quant.get("checkpoint_format") or quant.get("format") or "gptq"
    if fmt not in ("gptq", "gptq_v2") or quant.get("is_marlin_format"):
        raise _refuse(f"GPTQ checkpoint_format={fmt!r}; 'gptq' and 'gptq_v2' load")
    if quant.get("pack_dtype", "int32") != "int32":
        raise _refuse(f"GPTQ pack_dtype={quant['pack_dtype']!r}; int32 loads")
    if quant.get("dynamic"):
        raise _refuse("GPTQ with per-module 'dynamic' overrides")
    return WeightQuant(
        method="gptq",
        bits=bits,
        group_size=int(quant.get("group_size", -1)),
        desc_act=bool(quant.get("desc_act", False)),
        zero_offset=1 if fmt == "gptq" else 0,
    )


def _awq(quant: dict[str, Any]) -> WeightQuant:
    version = str(quant.get("version", "gemm")).lower()
    bits = int(quant.get("bits", quant.get("w_bit", 4)))
    if version != "gemm":
        raise _refuse(f"AWQ version={version!r}; 'gemm' loads")
    if bits != 4:
        raise _refuse(f"AWQ bits={bits}; 4 bits load")
    if not quant.get("zero_point", True):
        raise _refuse("AWQ zero_point=false; AWQ GEMM checkpoints with zero points load")
    return WeightQuant(
        method="awq", bits=4, group_size=int(quant.get("group_size", quant.get("q_group_size", -1)))
    )


def _fp8(quant: dict[str, Any]) -> WeightQuant:
    """vLLM's own fp8 format without ``weight_block_size`` (AutoFP8, older llm-compressor exports):
    each quantized linear stores ``weight`` in e4m3 and a ``weight_scale`` per tensor or per output
    channel; static activation scales (``input_scale``) are dropped. Modules in ``ignored_layers`` /
    ``modules_to_not_convert`` are stored unquantized, so they load as usual."""
    if quant.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"fp8 checkpoints in format {quant.get('fmt')!r} are not supported (only e4m3)")
    if quant.get("activation_scheme", "dynamic") not in ("static", "dynamic"):
        raise _refuse(f"fp8 activation_scheme={quant['activation_scheme']!r}; 'static' and 'dynamic' load")
    return WeightQuant(method="fp8", bits=8)


def _compressed_tensors(quant: dict[str, Any]) -> WeightQuant:
    kv = quant.get("kv_cache_scheme")
    if kv and (kv.get("type", "float"), int(kv.get("num_bits", 8)), kv.get("strategy", "tensor")) != (
        "float",
        8,
        "tensor",
    ):
        # Per-tensor fp8 K/V scales are read by the runner (engine/kv_scales.py); others are not.
        raise _refuse(f"compressed-tensors kv_cache_scheme {kv!r}; per-tensor 8-bit float loads")
    if quant.get("sparsity_config") or quant.get("transform_config"):
        raise _refuse("compressed-tensors sparsity_config / transform_config")
    top_format = quant.get("format", "dense")
    schemes = []
    for name, group in (quant.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        fmt = group.get("format") or top_format
        kind, bits, strategy = w.get("type", "int"), int(w.get("num_bits", 8)), w.get("strategy", "tensor")
        if fmt not in _CT_FORMATS:
            raise _refuse(f"compressed-tensors format {fmt!r}; {', '.join(_CT_FORMATS)} load")
        if strategy not in _CT_STRATEGIES or w.get("dynamic"):
            raise _refuse(f"compressed-tensors weight strategy {strategy!r} (dynamic={w.get('dynamic')})")
        if kind == "int":
            ok = bits in (4, 8) if fmt == "pack-quantized" else bits == 8 and fmt != "float-quantized"
        else:
            ok = kind == "float" and bits == 8 and fmt in ("float-quantized", "naive-quantized")
        if not ok or (strategy == "block" and kind != "float"):
            raise _refuse(f"compressed-tensors {kind} {bits}-bit weights in {fmt!r} ({name})")
        if group.get("output_activations"):
            raise _refuse(f"compressed-tensors output_activations quantization ({name})")
        block = w.get("block_structure")
        schemes.append(
            CTScheme(
                targets=tuple(group.get("targets") or ()),
                format=fmt,
                type=kind,
                bits=bits,
                strategy=strategy,
                group_size=w.get("group_size"),
                symmetric=bool(w.get("symmetric", True)),
                block=(int(block[0]), int(block[1])) if block else None,
            )
        )
    if not schemes:
        raise _refuse("compressed-tensors without config_groups")
    return WeightQuant(method="compressed-tensors", schemes=tuple(schemes))


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
