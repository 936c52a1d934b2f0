"""What an embedding's consumer does to the engine's pooled hidden state: keep the first
``dimensions`` values (Matryoshka models) and L2-normalise, vectorised in float64 (the server runs
this on its event loop for up to 2,048 inputs at a time); a classifier's consumer to its logits
(``activate``: the activation ``engine/classifier.py`` names); and the binary form of either
(``encode_values``: vLLM's ``embed_dtype`` and ``endianness``, the bits torch's cast of the float32
values gives). numpy, not torch: API server processes (``--api-server-count``) import this and
never load torch."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import numpy as np

_ORDER = {"native": "=", "big": ">", "little": "<"}  # vLLM's endianness names


def truncated(vector: list[float], dimensions: int | None = None) -> np.ndarray:
    """float64 ``vector[:dimensions]``, not normalised (a request that asked for the raw state)."""
    return np.asarray(vector[:dimensions] if dimensions is not None else vector, dtype=np.float64)


def normalized(vector: list[float], dimensions: int | None = None) -> np.ndarray:
    """float64 ``vector[:dimensions]`` divided by its L2 norm (a zero vector stays zero)."""
    v = truncated(vector, dimensions)
    norm = float(np.linalg.norm(v))
    return v / norm if norm > 0 else v


def encode_values(v: np.ndarray, embed_dtype: str = "float32", endianness: str = "native") -> bytes:
    """``v`` rounded to float32 (what the float answer lists), then cast to ``embed_dtype`` as torch
    casts (round to nearest even; fp8 ``e4m3`` is torch's ``float8_e4m3fn``, saturating at ±448;
    ``e5m2`` overflows to infinity), in ``endianness``'s byte order (``native``: this machine's,
    ``sys.byteorder``). bfloat16 and fp8, which numpy lacks, are their bit patterns."""
    cast = _CASTS.get(embed_dtype)
    if cast is None or endianness not in _ORDER:
        raise ValueError(f"unknown embed_dtype {embed_dtype!r} or endianness {endianness!r}")
    with np.errstate(over="ignore"):  # past a format's range: its infinity (e4m3: 448)
        out = cast(np.ascontiguousarray(np.asarray(v, dtype=np.float64).astype(np.float32).ravel()))
    order = _ORDER[endianness] if out.itemsize > 1 else "|"
    return out.astype(out.dtype.newbyteorder(order), copy=False).tobytes()


def _bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, rounding to nearest even. Every NaN, whatever its sign and payload,
    is 0xFFFF, as torch's vectorised CPU cast writes it (AVX2 / AVX512, what vLLM's
    ``tensor.to(torch.bfloat16)`` of the float32 output runs on an x86 server; torch's scalar path,
    a 0-d tensor or ``ATEN_CPU_CAPABILITY=default``, writes 0x7FC0 instead)."""
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0xFFFF), rounded)


def _fp8_bits(x: np.ndarray, *, mantissa: int, bias: int, saturate: bool) -> np.ndarray:
    """float32 -> 8-bit float bits (1 sign, ``7 - mantissa`` exponent bits), rounding to nearest
    even, as torch casts on the CPU: e4m3fn (no infinity) saturates at its largest finite value
    (±448, infinities too), e5m2 overflows to infinity; NaN stays NaN. Below the smallest normal, the
    float32 sum with a power of two whose last mantissa bit is the format's smallest subnormal
    does the rounding."""
    bits = x.view(np.uint32).astype(np.uint64)
    sign = ((bits >> 24) & 0x80).astype(np.uint8)
    mag = bits & 0x7FFFFFFF
    shift = 23 - mantissa
    # Normal results: rebias the exponent, round the dropped bits to nearest even.
    odd = (mag >> shift) & 1
    normal = ((mag - ((127 - bias) << 23) + ((1 << (shift - 1)) - 1) + odd) >> shift) & 0xFF
    # Subnormal results (below 2 ** (1 - bias)).
    denorm = np.array([(127 - bias + shift + 1) << 23], dtype=np.uint32)
    lifted = (mag.astype(np.uint32).view(np.float32) + denorm.view(np.float32)).view(np.uint32)
    sub = (lifted.astype(np.uint64) - denorm.astype(np.uint64)) & 0xFF
    out = np.where(mag < ((127 - bias + 1) << 23), sub, normal)
    if saturate:  # e4m3fn: everything past 448 (0x43E00000) is 448
        out = np.where(mag > 0x43E00000, np.uint64(0x7E), out)
    else:  # e5m2: 65536 and up (past the largest finite, 57344, once rounded) is infinity
        out = np.where(mag >= (143 << 23), np.uint64(0x7C), out)
    out = np.where(mag > (0xFF << 23), np.uint64(0x7F), out)  # NaN
    return out.astype(np.uint8) | sign


def float32_values(v: np.ndarray) -> list[float]:
    """``v`` rounded to float32, as Python floats: exactly what ``encode_values`` encodes as float32."""
    return np.asarray(v).astype(np.float32).tolist()


def activate(logits: Sequence[float] | np.ndarray, kind: str) -> np.ndarray:
    """float64 ``kind`` of ``logits`` over its last axis (softmax max-shifted; the sigmoid as
    ``(1 + tanh(x / 2)) / 2``, which never overflows)."""
    x = np.asarray(logits, dtype=np.float64)
    if kind == "softmax":
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)
    if kind == "sigmoid":
        return 0.5 * (1.0 + np.tanh(0.5 * x))
    return x


# vLLM's embed_dtype names (``server.embedding_protocol.EmbedDType``, which the router imports without numpy).
_CASTS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "float32": lambda x: x,
    "float16": lambda x: x.astype(np.float16),
    "bfloat16": _bfloat16_bits,
    "fp8_e4m3": partial(_fp8_bits, mantissa=3, bias=7, saturate=True),
    "fp8_e5m2": partial(_fp8_bits, mantissa=2, bias=15, saturate=False),
}
EMBED_DTYPES = tuple(_CASTS)
ENDIANNESS = tuple(_ORDER)
