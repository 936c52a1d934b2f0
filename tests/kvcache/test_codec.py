"""Block codec: exact round trips and sizes, and every kind of bad value is a counted miss."""

from __future__ import annotations

import struct

import pytest
import torch

from kvcache import codec
from kvcache.keys import ROOT_HASH, block_hashes

SHAPE = (2, 2, 16, 2, 8)  # (num_layers, 2, block_size, num_kv_heads, head_dim)
H0, H1 = block_hashes(list(range(32)), 16)


def _block(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g).to(dtype)


@pytest.mark.parametrize(
    ("dtype", "nbytes"),
    [(torch.float32, 64 + 1024 * 4), (torch.bfloat16, 64 + 1024 * 2), (torch.float16, 64 + 1024 * 2)],
)
def test_round_trip_exact(dtype: torch.dtype, nbytes: int) -> None:
    t = _block(dtype)
    data = codec.encode(H0, t)
    assert len(data) == nbytes == codec.encoded_size(dtype, SHAPE)
    assert data[:4] == b"FKVB"
    out = codec.decode(H0, data, dtype, SHAPE)
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
    data = codec.encode(H1, t)
    magic, version, code, ndim, *rest = struct.unpack_from("<4sHBB6IQ16sI", data)
    assert (magic, version, code, ndim) == (b"FKVB", 1, 1, 5)
    assert rest[:6] == [2, 2, 16, 2, 8, 0]
    assert rest[6] == 1024 * 4 and rest[7] == H1 and rest[8] == 0
    assert torch.equal(codec.decode(H1, data, torch.float32, SHAPE), t)


def _rejected(
    metric, data: object, reason: str, *, block_hash: bytes = H0, dtype=torch.float32, shape=SHAPE
) -> None:
    before = metric("ferry:kv_tier_errors_total", kind="corrupt")
    assert codec.decode_with_reason(block_hash, data, dtype, shape) == (None, reason)
    assert codec.decode(block_hash, data, dtype, shape) is None
    assert metric("ferry:kv_tier_errors_total", kind="corrupt") == before + 1


def test_flipped_bytes_anywhere_are_rejected(metric) -> None:
    good = codec.encode(H0, _block(torch.float32))
    size = len(good)

    def flip(i: int) -> bytes:
        b = bytearray(good)
        b[i] ^= 0x01
        return bytes(b)

    _rejected(metric, flip(0), "magic")
    _rejected(metric, flip(4), "version")
    _rejected(metric, flip(6), "dtype")
    _rejected(metric, flip(7), "shape")  # ndim
    _rejected(metric, flip(8), "shape")  # first dim
    _rejected(metric, flip(32), "size")  # payload length
    _rejected(metric, flip(40), "hash")  # first byte of the stored block hash
    _rejected(metric, flip(55), "hash")  # last byte of the stored block hash
    _rejected(metric, flip(56), "header")  # reserved
    _rejected(metric, flip(60), "checksum")  # the crc itself
    for i in (64, 65, size // 2, size - 1):  # payload
        _rejected(metric, flip(i), "checksum")


def test_wrong_key_dtype_or_shape_is_rejected(metric) -> None:
    good = codec.encode(H0, _block(torch.bfloat16))
    bf16 = torch.bfloat16
    _rejected(metric, good, "hash", block_hash=H1, dtype=bf16)  # a value stored under another block's key
    _rejected(metric, good, "hash", block_hash=ROOT_HASH, dtype=bf16)
    _rejected(metric, good, "dtype", dtype=torch.float16)  # same size, other dtype
    _rejected(metric, good, "shape", dtype=torch.bfloat16, shape=(2, 2, 16, 8, 2))
    _rejected(metric, good, "shape", dtype=torch.bfloat16, shape=(2, 2, 16, 2))


def test_truncated_garbage_and_empty_values_never_raise(metric) -> None:
    good = codec.encode(H0, _block(torch.float32))
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
    struct.pack_into("<Q", evil, 32, 1 << 62)
    _rejected(metric, bytes(evil), "size")


def test_decode_accepts_bytearray_and_memoryview() -> None:
    t = _block(torch.float16)
    data = codec.encode(H0, t)
    for buf in (bytearray(data), memoryview(data)):
        assert torch.equal(codec.decode(H0, buf, torch.float16, SHAPE), t)


def test_encode_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        codec.encode(b"short", _block(torch.float32))
    with pytest.raises(ValueError, match="cannot be stored"):
        codec.encode(H0, torch.zeros(SHAPE, dtype=torch.complex64))


def test_a_rejected_block_is_a_warning_once_a_minute(caplog, monkeypatch) -> None:
    good = codec.encode(H0, _block(torch.float32))
    monkeypatch.setattr(codec, "_last_rejection_warning", -codec.REJECTION_LOG_INTERVAL_S)
    with caplog.at_level("DEBUG", logger="kvcache.codec"):
        for _ in range(3):
            assert codec.decode(H0, good[:-1], torch.float32, SHAPE) is None
    levels = [(r.levelname, "truncated" in r.getMessage()) for r in caplog.records]
    assert levels == [("WARNING", True), ("DEBUG", True), ("DEBUG", True)]
    assert H0.hex() in caplog.records[0].getMessage()
