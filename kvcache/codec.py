"""The byte format of one stored KV block: a fixed 64-byte header + the raw tensor bytes.

Header (little-endian, ``struct`` format ``<4sHBB6IQ16sII``):

    magic "FKVB" | format version u16 | dtype code u8 | ndim u8 | shape 6 x u32 (unused = 0)
    | payload length u64 | block hash 16 B | reserved u32 (0) | crc32 u32

The crc32 covers the first 60 header bytes and the payload, so a flipped byte anywhere is
caught; the block hash inside the value catches a value stored under the wrong key. The
payload is the tensor's bytes in C order — for a tier block, shape
``(num_layers, 2, block_size, num_kv_heads, head_dim)`` — or ``(num_layers, 1, block_size, 1,
latent_dim)`` for an MLA model (ARCHITECTURE.md).

Decoding reads untrusted bytes: it only unpacks fixed-size integers and views the payload
(``torch.frombuffer``) — never pickle, eval or torch.load — and it never raises. A bad value
returns ``None``, increments ``ferry:kv_tier_errors_total{kind="corrupt"}`` and says why
through ``decode_with_reason``.
"""

from __future__ import annotations

import logging
import math
import struct
import time
import warnings
import zlib
from collections.abc import Sequence

import torch

from kvcache.keys import DIGEST_SIZE
from kvcache.metrics import ERROR_CORRUPT, KV_TIER_ERRORS

logger = logging.getLogger(__name__)

MAGIC = b"FKVB"
FORMAT_VERSION = 1
MAX_DIMS = 6
_PREFIX = struct.Struct(f"<4sHBB{MAX_DIMS}IQ{DIGEST_SIZE}sI")  # everything the crc covers
_CRC = struct.Struct("<I")
HEADER_SIZE = _PREFIX.size + _CRC.size
assert HEADER_SIZE == 64  # keeps the payload 64-byte aligned relative to the value start

DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
    torch.float8_e4m3fn: 5,
    torch.float8_e5m2: 6,
    torch.int8: 7,
    torch.uint8: 8,
}

# Why a value was rejected (the ``reason`` of decode_with_reason).
BAD_TYPE = "type"
TRUNCATED = "truncated"
BAD_MAGIC = "magic"
BAD_VERSION = "version"
BAD_DTYPE = "dtype"
BAD_SHAPE = "shape"
BAD_SIZE = "size"
BAD_HASH = "hash"
BAD_HEADER = "header"
BAD_CHECKSUM = "checksum"
INTERNAL = "internal"

# Values come from Redis as immutable ``bytes``; the decoded tensor is a read-only view used
# only as a copy source, so torch's "buffer is not writable" warning is noise here.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


def encoded_size(dtype: torch.dtype, shape: Sequence[int]) -> int:
    """Exact length of an encoded block of this dtype and shape."""
    return HEADER_SIZE + math.prod(shape) * dtype.itemsize


def encode(block_hash: bytes, tensor: torch.Tensor) -> bytes:
    """Serialize one block (any device; copied to CPU if needed) under its block hash."""
    if len(block_hash) != DIGEST_SIZE:
        raise ValueError(f"block hash must be {DIGEST_SIZE} bytes, got {len(block_hash)}")
    code = DTYPE_CODES.get(tensor.dtype)
    if code is None:
        raise ValueError(f"dtype {tensor.dtype} cannot be stored in the KV tier")
    if tensor.dim() > MAX_DIMS:
        raise ValueError(f"at most {MAX_DIMS} dims, got {tensor.dim()}")
    t = tensor.detach().to("cpu").contiguous()
    payload = memoryview(t.reshape(-1).view(torch.uint8).numpy())
    shape = list(t.shape) + [0] * (MAX_DIMS - t.dim())
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, code, t.dim(), *shape, payload.nbytes, block_hash, 0)
    crc = zlib.crc32(payload, zlib.crc32(prefix))
    return b"".join((prefix, _CRC.pack(crc), payload))


def decode_with_reason(
    block_hash: bytes, data: object, expected_dtype: torch.dtype, expected_shape: Sequence[int]
) -> tuple[torch.Tensor | None, str | None]:
    """``(tensor, None)`` for a good value, ``(None, reason)`` for a bad one; never raises.

    The tensor is a zero-copy, read-only view of ``data``: copy out of it, never write to it.
    """
    try:
        reason = _check(block_hash, data, expected_dtype, tuple(expected_shape))
        if reason is not None:
            return None, reason
        numel = math.prod(expected_shape)
        view = torch.frombuffer(data, dtype=expected_dtype, offset=HEADER_SIZE, count=numel)  # type: ignore[arg-type]
        return view.view(tuple(expected_shape)), None
    except Exception:
        logger.exception("unexpected failure decoding a KV block")
        return None, INTERNAL


def decode(
    block_hash: bytes, data: object, expected_dtype: torch.dtype, expected_shape: Sequence[int]
) -> torch.Tensor | None:
    """The block's tensor, or ``None`` (counted as a corrupt value) if anything is off."""
    tensor, reason = decode_with_reason(block_hash, data, expected_dtype, expected_shape)
    if tensor is None:
        KV_TIER_ERRORS.labels(kind=ERROR_CORRUPT).inc()
        _log_rejection(block_hash, reason)
    return tensor


REJECTION_LOG_INTERVAL_S = 60.0
_last_rejection_warning = -REJECTION_LOG_INTERVAL_S


def _log_rejection(block_hash: bytes, reason: str | None) -> None:
    """A warning for the first rejected block in a minute (a tier with bad values says so without
    flooding the log; every rejection is counted), the rest at debug level."""
    global _last_rejection_warning
    now = time.monotonic()
    if now - _last_rejection_warning >= REJECTION_LOG_INTERVAL_S:
        _last_rejection_warning = now
        logger.warning(
            "rejected a KV block from the tier (%s, block %s): recomputed instead; "
            'ferry:kv_tier_errors_total{kind="corrupt"} counts every one',
            reason,
            block_hash.hex(),
        )
    else:
        logger.debug("rejected KV block %s: %s", block_hash.hex(), reason)


def _check(block_hash: bytes, data: object, dtype: torch.dtype, shape: tuple[int, ...]) -> str | None:
    if not isinstance(data, bytes | bytearray | memoryview):
        return BAD_TYPE
    buf = memoryview(data)
    if buf.ndim != 1 or buf.itemsize != 1:
        return BAD_TYPE
    if buf.nbytes < HEADER_SIZE:
        return TRUNCATED
    magic, version, code, ndim, *rest = _PREFIX.unpack_from(buf, 0)
    dims, (payload_len, stored_hash, reserved) = rest[:MAX_DIMS], rest[MAX_DIMS:]
    if magic != MAGIC:
        return BAD_MAGIC
    if version != FORMAT_VERSION:
        return BAD_VERSION
    if code != DTYPE_CODES.get(dtype):
        return BAD_DTYPE
    if ndim != len(shape) or tuple(dims[:ndim]) != shape or any(dims[ndim:]):
        return BAD_SHAPE
    if payload_len != math.prod(shape) * dtype.itemsize:
        return BAD_SIZE
    if buf.nbytes != HEADER_SIZE + payload_len:
        return TRUNCATED if buf.nbytes < HEADER_SIZE + payload_len else BAD_SIZE
    if stored_hash != block_hash:
        return BAD_HASH
    if reserved != 0:
        return BAD_HEADER
    (crc,) = _CRC.unpack_from(buf, _PREFIX.size)
    if zlib.crc32(buf[HEADER_SIZE:], zlib.crc32(buf[: _PREFIX.size])) != crc:
        return BAD_CHECKSUM
    return None
