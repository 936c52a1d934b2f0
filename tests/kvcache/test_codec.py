"""Block codec: exact round trips and sizes, and every kind of bad value is a counted miss."""

from __future__ import annotations

import hashlib
import struct

import pytest
import torch

from kvcache import codec
from kvcache.keys import ROOT_HASH, block_hashes

SHAPE = (2, 2, 16, 2, 8)  # (num_layers, 2, block_size, num_kv_heads, head_dim)
H0, H1 = block_hashes(list(range(32)), 16)
FP = "0123456789abcdef"


def _block(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g).to(dtype)


@pytest.mark.parametrize(
    ("dtype", "nbytes"),
    [(torch.float32, 64 + 1024 * 4), (torch.bfloat16, 64 + 1024 * 2), (torch.float16, 64 + 1024 * 2)],
)
def test_round_trip_exact(dtype: torch.dtype, nbytes: int) -> None:
    t = _block(dtype)
    data = codec.encode(H0, t, fingerprint=FP)
    assert len(data) == nbytes == codec.encoded_size(dtype, SHAPE)
    assert data[:4] == b"FKVB"
    out = codec.decode(H0, data, dtype, SHAPE, fingerprint=FP)
    assert out is not None and out.dtype == dtype and tuple(out.shape) == SHAPE
    # Bit-exact (compare raw bits so bf16/fp16 NaN-free equality is not the only check).
    assert torch.equal(
        out.view(torch.int16 if dtype.itemsize == 2 else torch.int32),
        t.view(torch.int16 if dtype.itemsize == 2 else torch.int32),
    )
    # The payload is the tensor's raw bytes in C order, right after the 64-byte header.
    assert data[codec.HEADER_SIZE :] == t.contiguous().view(torch.uint8).numpy().tobytes()


def test_encode_non_contiguous_and_header_fields() -> None:
    base = torch.arange(2 * 16 * 2 * 8 * 2, dtype=torch.float32).reshape(2, 16, 2, 8, 2)
    t = base.permute(0, 4, 1, 2, 3)  # non-contiguous view of shape SHAPE
    data = codec.encode(H1, t, fingerprint=FP)
    magic, version, code, ndim, *rest = struct.unpack_from("<4sHBB5IQ8s16sI", data)
    assert (magic, version, code, ndim) == (b"FKVB", 2, 1, 5)
    assert rest[:5] == [2, 2, 16, 2, 8]
    assert rest[5] == 1024 * 4 and rest[6] == codec.fingerprint_tag(FP) and rest[7] == H1
    assert rest[6] == hashlib.blake2b(b"ferry-kv-fp\x00" + FP.encode(), digest_size=8).digest()
    assert torch.equal(codec.decode(H1, data, torch.float32, SHAPE, fingerprint=FP), t)


def _rejected(
    metric,
    data: object,
    reason: str,
    *,
    block_hash: bytes = H0,
    dtype=torch.float32,
    shape=SHAPE,
    fingerprint: str = FP,
    kind: str = "corrupt",
) -> None:
    other = "mismatch" if kind == "corrupt" else "corrupt"
    before, before_other = (metric("ferry:kv_tier_errors_total", kind=k) for k in (kind, other))
    assert codec.decode_with_reason(block_hash, data, dtype, shape, fingerprint=fingerprint) == (None, reason)
    assert codec.decode(block_hash, data, dtype, shape, fingerprint=fingerprint) is None
    assert metric("ferry:kv_tier_errors_total", kind=kind) == before + 1
    assert metric("ferry:kv_tier_errors_total", kind=other) == before_other


def test_flipped_bytes_anywhere_are_rejected(metric) -> None:
    good = codec.encode(H0, _block(torch.float32), fingerprint=FP)
    size = len(good)

    def flip(i: int) -> bytes:
        b = bytearray(good)
        b[i] ^= 0x01
        return bytes(b)

    _rejected(metric, flip(0), "magic")
    # A version byte cannot be told from a newer format's: refused as another format's block.
    _rejected(metric, flip(4), "version", kind="mismatch")
    _rejected(metric, flip(28), "truncated")  # payload length: now claims more than the value holds
    # Every other header byte (dtype, ndim, shape, fingerprint tag, block hash) and the crc itself:
    # damage the checksum catches before the fields are believed.
    for i in (6, 7, 8, 27, 36, 43, 44, 59, 60, 63):
        _rejected(metric, flip(i), "checksum")
    for i in (64, 65, size // 2, size - 1):  # payload
        _rejected(metric, flip(i), "checksum")


def test_wrong_key_model_dtype_or_shape_is_a_mismatch(metric) -> None:
    good = codec.encode(H0, _block(torch.bfloat16), fingerprint=FP)
    bf16 = torch.bfloat16
    # A value stored under another block's key:
    _rejected(metric, good, "hash", block_hash=H1, dtype=bf16, kind="mismatch")
    _rejected(metric, good, "hash", block_hash=ROOT_HASH, dtype=bf16, kind="mismatch")
    # Written by another model (fingerprint), or read with another KV layout (dtype, shape):
    _rejected(metric, good, "fingerprint", dtype=bf16, fingerprint="fedcba9876543210", kind="mismatch")
    _rejected(metric, good, "dtype", dtype=torch.float16, kind="mismatch")  # same size, other dtype
    _rejected(metric, good, "shape", dtype=bf16, shape=(2, 2, 16, 8, 2), kind="mismatch")
    _rejected(metric, good, "shape", dtype=bf16, shape=(2, 2, 16, 2), kind="mismatch")


def test_truncated_garbage_and_empty_values_never_raise(metric) -> None:
    good = codec.encode(H0, _block(torch.float32), fingerprint=FP)
    _rejected(metric, b"", "truncated")
    _rejected(metric, good[:10], "truncated")
    _rejected(metric, good[:64], "truncated")
    _rejected(metric, good[:-1], "truncated")
    _rejected(metric, good + b"\0", "size")
    _rejected(metric, b"\xff" * len(good), "magic")
    _rejected(metric, None, "type")
    _rejected(metric, "FKVB" + "x" * 100, "type")
    _rejected(metric, memoryview(good).cast("I"), "type")
    # A header that claims an absurd payload must not allocate or raise.
    evil = bytearray(good)
    struct.pack_into("<Q", evil, 28, 1 << 62)
    _rejected(metric, bytes(evil), "truncated")


def test_decode_accepts_bytearray_and_memoryview() -> None:
    t = _block(torch.float16)
    data = codec.encode(H0, t, fingerprint=FP)
    for buf in (bytearray(data), memoryview(data)):
        assert torch.equal(codec.decode(H0, buf, torch.float16, SHAPE, fingerprint=FP), t)


def test_encode_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        codec.encode(b"short", _block(torch.float32), fingerprint=FP)
    with pytest.raises(ValueError, match="cannot be stored"):
        codec.encode(H0, torch.zeros(SHAPE, dtype=torch.complex64), fingerprint=FP)


def test_a_rejected_block_is_a_warning_once_a_minute(caplog, monkeypatch) -> None:
    good = codec.encode(H0, _block(torch.float32), fingerprint=FP)
    monkeypatch.setattr(codec, "_last_rejection_warning", -codec.REJECTION_LOG_INTERVAL_S)
    with caplog.at_level("DEBUG", logger="kvcache.codec"):
        for _ in range(3):
            assert codec.decode(H0, good[:-1], torch.float32, SHAPE, fingerprint=FP) is None
    levels = [(r.levelname, "truncated" in r.getMessage()) for r in caplog.records]
    assert levels == [("WARNING", True), ("DEBUG", True), ("DEBUG", True)]
    assert H0.hex() in caplog.records[0].getMessage()
