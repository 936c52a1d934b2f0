"""Block hashes are a wire format: every replica and router must compute the same bytes."""

from __future__ import annotations

import hashlib
import random
import struct

import pytest

from kvcache.keys import ROOT_HASH, block_hashes, extend_hashes, hash_block, tier_key


def reference(token_ids: list[int], block_size: int, extra: bytes = b"") -> list[bytes]:
    """The formula of kvcache/keys.py's docstring, written out block by block."""
    parent = hashlib.blake2b(b"ferry-kv-root/v1", digest_size=16).digest()
    out = []
    for start in range(0, len(token_ids) // block_size * block_size, block_size):
        block = token_ids[start : start + block_size]
        data = (
            parent
            + b"T"
            + struct.pack(f"<{len(block)}q", *block)
            + b"X"
            + struct.pack("<I", len(extra))
            + extra
        )
        parent = hashlib.blake2b(data, digest_size=16).digest()
        out.append(parent)
    return out


def test_root_and_first_block_are_pinned() -> None:
    assert ROOT_HASH == hashlib.blake2b(b"ferry-kv-root/v1", digest_size=16).digest()
    first = block_hashes(list(range(16)), 16)
    assert len(first) == 1 and first[0] == reference(list(range(16)), 16)[0]
    assert tier_key("fp", first[0]) == f"ferry:kv:fp:{first[0].hex()}"


@pytest.mark.parametrize(("block_size", "extra"), [(16, b""), (7, b"lora-1"), (1, b"")])
def test_block_hashes_follow_the_formula(block_size: int, extra: bytes) -> None:
    rng = random.Random(block_size)
    ids = [rng.randrange(-(2**40), 2**40) for _ in range(16 * 20 + 5)]
    got = block_hashes(ids, block_size, extra)
    assert got == reference(ids, block_size, extra)
    assert len(got) == len(ids) // block_size  # the trailing partial block is not hashed
    assert got[-1] == hash_block(got[-2], ids[(len(got) - 1) * block_size : len(got) * block_size], extra)


def test_extend_hashes_continues_the_chain() -> None:
    ids = list(range(1000, 1000 + 16 * 9 + 3))
    partial = block_hashes(ids[:40], 16)  # two full blocks
    assert extend_hashes(partial, ids, 16) is partial
    assert partial == block_hashes(ids, 16)
    assert extend_hashes([], ids[:15], 16) == []


def test_extra_and_order_change_every_hash() -> None:
    ids = list(range(64))
    plain = block_hashes(ids, 16)
    assert not set(plain) & set(block_hashes(ids, 16, b"x"))
    swapped = ids[:]
    swapped[0], swapped[1] = swapped[1], swapped[0]
    assert not set(plain) & set(block_hashes(swapped, 16))  # a change in block 0 reaches every later hash
