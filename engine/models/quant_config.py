"""A checkpoint's ``quantization_config`` read once into a frozen :class:`WeightQuant`: which method
(GPTQ, AWQ, compressed-tensors, vLLM's per-tensor / per-channel fp8, MXFP4), its bits, groups and
compressed-tensors schemes, and which checkpoint tensors are pieces of a quantized module. A
variant it does not know is refused by name here, before any weight is touched; vLLM's
``--quantization`` is checked against the checkpoint's method (``check_quantization``). Turning
the pieces into float weights is ``engine/models/quantized.py``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

# MXFP4 (gpt-oss experts): ``<name>_blocks`` uint8 [E, out, in/32, 16], two 4-bit floats (e2m1) a
# byte, the low nibble first; ``<name>_scales`` uint8 [E, out, in/32], one power of two (e8m0, bias
# 127) per 32 values along the input dimension (decoded by ``quantized.py``'s ``FP4_VALUES``).
_MXFP4_PARTS = ("_blocks", "_scales")
MXFP4_GROUP = 32
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
