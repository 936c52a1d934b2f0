"""The byte format of one stored KV block: a fixed 64-byte header + the raw tensor bytes.

Header (little-endian, ``struct`` format ``<4sHBB5IQ8s16sI``), format version 2:

    magic "FKVB" | format version u16 | dtype code u8 | ndim u8 | shape 5 x u32 (unused = 0)
    | payload length u64 | fingerprint tag 8 B | block hash 16 B | crc32 u32

The crc32 covers the first 60 header bytes and the payload, so a flipped byte anywhere is
caught. The fingerprint tag (``fingerprint_tag``: blake2b-64 of the model fingerprint the block
was computed under) and the block hash make a value self-describing: a reader refuses a value
written by another model, another KV layout or for another block even when it sits under one of
its own keys (a value copied or renamed across namespaces, a fingerprint collision, a writer
bug). The payload is the tensor's bytes in C order — for a tier block, shape
``(num_layers, 2, block_size, num_kv_heads, head_dim)`` — or ``(num_layers, 1, block_size, 1,
latent_dim)`` for an MLA model (ARCHITECTURE.md).

Decoding reads untrusted bytes: it only unpacks fixed-size integers and views the payload
(``torch.frombuffer``) — never pickle, eval or torch.load — and it never raises. A bad value
returns ``None`` and is counted in ``ferry:kv_tier_errors_total`` under one of two kinds, so an
operator can tell damage from misconfiguration: ``corrupt`` (truncated, bad magic, failed crc, a
header that contradicts itself) or ``mismatch`` (an intact block that is not the one asked for:
another format version, model fingerprint, dtype, shape or block hash). ``decode_with_reason``
says why.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import struct
import time
import warnings
import zlib
from collections.abc import Sequence

import torch

from kvcache.keys import DIGEST_SIZE
from kvcache.metrics import ERROR_CORRUPT, ERROR_MISMATCH, KV_TIER_ERRORS

logger = logging.getLogger(__name__)

MAGIC = b"FKVB"
# 2: the fingerprint tag replaced the reserved field and the sixth shape dim. Values of version 1
# (written before) are refused as a "version" mismatch and rewritten by the first replica that
# recomputes them.
FORMAT_VERSION = 2
MAX_DIMS = 5
TAG_SIZE = 8
_PREFIX = struct.Struct(f"<4sHBB{MAX_DIMS}IQ{TAG_SIZE}s{DIGEST_SIZE}s")  # everything the crc covers
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
_ITEMSIZE_BY_CODE = {code: dtype.itemsize for dtype, code in DTYPE_CODES.items()}

# Why a value was rejected (the ``reason`` of decode_with_reason). Damaged or malformed bytes:
BAD_TYPE = "type"
TRUNCATED = "truncated"
BAD_MAGIC = "magic"
BAD_SIZE = "size"
BAD_HEADER = "header"
BAD_CHECKSUM = "checksum"
INTERNAL = "internal"
# An intact block that is not the one asked for (another format, model, layout or block):
BAD_VERSION = "version"
BAD_FINGERPRINT = "fingerprint"
BAD_DTYPE = "dtype"
BAD_SHAPE = "shape"
BAD_HASH = "hash"
MISMATCH_REASONS = frozenset({BAD_VERSION, BAD_FINGERPRINT, BAD_DTYPE, BAD_SHAPE, BAD_HASH})

# Values come from Redis as immutable ``bytes``; the decoded tensor is a read-only view used
# only as a copy source, so torch's "buffer is not writable" warning is noise here.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


@functools.lru_cache(maxsize=64)
def fingerprint_tag(fingerprint: str) -> bytes:
    """The 8 bytes a block's header carries for the model fingerprint it was computed under."""
    return hashlib.blake2b(b"ferry-kv-fp\x00" + fingerprint.encode(), digest_size=TAG_SIZE).digest()


def encoded_size(dtype: torch.dtype, shape: Sequence[int]) -> int:
    """Exact length of an encoded block of this dtype and shape."""
    return HEADER_SIZE + math.prod(shape) * dtype.itemsize


def encode(block_hash: bytes, tensor: torch.Tensor, *, fingerprint: str) -> bytes:
    """Serialize one block (any device; copied to CPU if needed) computed under model
    ``fingerprint`` (the one in its tier key) for block ``block_hash``."""
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
    prefix = _PREFIX.pack(
        MAGIC, FORMAT_VERSION, code, t.dim(), *shape, payload.nbytes, fingerprint_tag(fingerprint), block_hash
    )
    crc = zlib.crc32(payload, zlib.crc32(prefix))
    return b"".join((prefix, _CRC.pack(crc), payload))


def decode_with_reason(
    block_hash: bytes,
    data: object,
    expected_dtype: torch.dtype,
    expected_shape: Sequence[int],
    *,
    fingerprint: str,
) -> tuple[torch.Tensor | None, str | None]:
    """``(tensor, None)`` for a good value of block ``block_hash`` under model ``fingerprint`` with
    this dtype and shape, ``(None, reason)`` for any other value; never raises, counts nothing.

    The tensor is a zero-copy, read-only view of ``data``: copy out of it, never write to it.
    """
    try:
        reason = _check(block_hash, data, fingerprint, expected_dtype, tuple(expected_shape))
        if reason is not None:
            return None, reason
        numel = math.prod(expected_shape)
        view = torch.frombuffer(data, dtype=expected_dtype, offset=HEADER_SIZE, count=numel)  # type: ignore[arg-type]
        return view.view(tuple(expected_shape)), None
    except Exception:
        logger.exception("unexpected failure decoding a KV block")
        return None, INTERNAL


def decode(
    block_hash: bytes,
    data: object,
    expected_dtype: torch.dtype,
    expected_shape: Sequence[int],
    *,
    fingerprint: str,
) -> torch.Tensor | None:
    """The block's tensor, or ``None`` (counted and logged by ``record_rejection``) if anything is off."""
    tensor, reason = decode_with_reason(
        block_hash, data, expected_dtype, expected_shape, fingerprint=fingerprint
    )
    if tensor is None:
        record_rejection(block_hash, reason or INTERNAL)
    return tensor


def rejection_kind(reason: str) -> str:
    """The ``ferry:kv_tier_errors_total`` kind of a rejection reason: ``mismatch`` or ``corrupt``."""
    return ERROR_MISMATCH if reason in MISMATCH_REASONS else ERROR_CORRUPT


def record_rejection(block_hash: bytes, reason: str) -> str:
    """Count one refused value in ``ferry:kv_tier_errors_total`` and log it; returns its kind."""
    kind = rejection_kind(reason)
    KV_TIER_ERRORS.labels(kind=kind).inc()
    if kind == ERROR_MISMATCH:
        _log_mismatch(block_hash, reason)
    else:
        _log_corruption(block_hash, reason)
    return kind


REJECTION_LOG_INTERVAL_S = 60.0
_last_rejection_warning = -REJECTION_LOG_INTERVAL_S
# Mismatch reasons already warned about: a foreign block comes from a standing configuration (two
# deployments in one namespace, a rolling upgrade), so one warning per reason says it; the metric
# counts every block.
_mismatches_warned: set[str] = set()


def _log_corruption(block_hash: bytes, reason: str) -> None:
    """A warning for the first corrupt block in a minute (a tier with bad values says so without
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


def _log_mismatch(block_hash: bytes, reason: str) -> None:
    if reason in _mismatches_warned:
        logger.debug("refused KV block %s of another model or layout: %s", block_hash.hex(), reason)
        return
    _mismatches_warned.add(reason)
    logger.warning(
        "refused a KV block from the tier whose header does not match this replica (%s differs, "
        "block %s): recomputed instead. Another model, KV layout or ferry version writes under these "
        'keys; ferry:kv_tier_errors_total{kind="mismatch"} counts every such block (logged once)',
        reason,
        block_hash.hex(),
    )


def _check(
    block_hash: bytes, data: object, fingerprint: str, dtype: torch.dtype, shape: tuple[int, ...]
) -> str | None:
    # Structure and checksum first, identity after: a damaged header byte is "corrupt", and only an
    # intact header that names another model or layout is a "mismatch".
    if not isinstance(data, bytes | bytearray | memoryview):
        return BAD_TYPE
    buf = memoryview(data)
    if buf.ndim != 1 or buf.itemsize != 1:
        return BAD_TYPE
    if buf.nbytes < HEADER_SIZE:
        return TRUNCATED
    magic, version, code, ndim, *rest = _PREFIX.unpack_from(buf, 0)
    dims, (payload_len, stored_tag, stored_hash) = rest[:MAX_DIMS], rest[MAX_DIMS:]
    if magic != MAGIC:
        return BAD_MAGIC
    if version != FORMAT_VERSION:
        return BAD_VERSION  # another format's fields cannot be read as ours
    if buf.nbytes != HEADER_SIZE + payload_len:
        return TRUNCATED if buf.nbytes < HEADER_SIZE + payload_len else BAD_SIZE
    (crc,) = _CRC.unpack_from(buf, _PREFIX.size)
    if zlib.crc32(buf[HEADER_SIZE:], zlib.crc32(buf[: _PREFIX.size])) != crc:
        return BAD_CHECKSUM
    itemsize = _ITEMSIZE_BY_CODE.get(code)
    if itemsize is None or ndim > MAX_DIMS or any(dims[ndim:]):
        return BAD_HEADER
    if payload_len != math.prod(dims[:ndim]) * itemsize:
        return BAD_HEADER
    if stored_tag != fingerprint_tag(fingerprint):
        return BAD_FINGERPRINT
    if code != DTYPE_CODES.get(dtype):
        return BAD_DTYPE
    if tuple(dims[:ndim]) != shape:
        return BAD_SHAPE
    if stored_hash != block_hash:
        return BAD_HASH
    return None
