"""KV block identity: the chained block hash, the tier key format and the model fingerprint.

Shared by engine, tier and router, so it must stay dependency-free (no torch, no numpy)
and must never change its byte encoding without bumping ``HASH_VERSION``: every replica
and router computes these values independently and they must agree bit for bit.

hash_i = blake2b-128(hash_{i-1} || "T" || int64-le token ids of block i || "X" || len(extra) || extra)
hash_{-1} = blake2b-128(b"ferry-kv-root/" + HASH_VERSION)

A block that holds (part of) an image's placeholder tokens adds ``image_extra`` of each such image
to its ``extra``: the same tokens with another image are other KV. Blocks without images keep the
bytes above, so text-only hashes never change.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable, Sequence

HASH_VERSION = "v1"
DIGEST_SIZE = 16
KEY_PREFIX = "ferry:kv"

ROOT_HASH: bytes = hashlib.blake2b(
    b"ferry-kv-root/" + HASH_VERSION.encode(), digest_size=DIGEST_SIZE
).digest()


def hash_block(parent: bytes, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    """Hash of one full block given its parent's hash, its tokens and extra keys (LoRA id, images…)."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    h.update(parent)
    h.update(b"T")
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    h.update(b"X")
    h.update(struct.pack("<I", len(extra)))
    h.update(extra)
    return h.digest()


# An image's placeholder run in a prompt: (first position, number of tokens, content digest).
ImageSpan = tuple[int, int, bytes]


def image_source_digest(data: bytes) -> bytes:
    """An image's content digest from its encoded bytes (what a data URL or a fetched URL carries):
    the same bytes decode to the same pixels, and a router can compute it without decoding."""
    return hashlib.blake2b(b"ferry-image-src/v1\x00" + data, digest_size=DIGEST_SIZE).digest()


def image_extra(spans: Sequence[ImageSpan], start: int, end: int) -> bytes:
    """What the images whose placeholder runs overlap positions ``[start, end)`` add to a block's
    ``extra``: each one's position, length and content digest, in prompt order (b"" for none)."""
    out = b""
    for first, length, digest in spans:
        if first < end and first + length > start:
            out += b"img\x00" + struct.pack("<qq", first, length) + digest
    return out


def _chain(
    out: list[bytes],
    parent: bytes,
    token_ids: Sequence[int],
    start: int,
    block_size: int,
    extra: bytes,
    images: Sequence[ImageSpan] = (),
) -> list[bytes]:
    """Append ``hash_block`` of each full block from ``start`` on: the same bytes, packed once for all
    blocks and hashed in one call per block (a router keys every prompt; long ones have thousands)."""
    num_blocks = (len(token_ids) - start) // block_size
    if num_blocks <= 0:
        return out
    width = 8 * block_size
    data = struct.pack(f"<{num_blocks * block_size}q", *token_ids[start : start + num_blocks * block_size])
    tail = b"X" + struct.pack("<I", len(extra)) + extra
    blake2b = hashlib.blake2b
    for offset in range(0, num_blocks * width, width):
        block_tail = tail
        if images:
            first = start + offset // 8
            more = image_extra(images, first, first + block_size)
            if more:
                block_tail = b"X" + struct.pack("<I", len(extra) + len(more)) + extra + more
        parent = blake2b(
            parent + b"T" + data[offset : offset + width] + block_tail, digest_size=DIGEST_SIZE
        ).digest()
        out.append(parent)
    return out


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    extra: bytes = b"",
    parent: bytes = ROOT_HASH,
    images: Sequence[ImageSpan] = (),
) -> list[bytes]:
    """Chained hashes of every *full* block of ``token_ids`` (a trailing partial block is not hashed);
    ``images``: the prompt's image placeholder runs (``image_extra``)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    return _chain([], parent, token_ids, 0, block_size, extra, images)


def extend_hashes(
    hashes: list[bytes],
    token_ids: Sequence[int],
    block_size: int,
    extra: bytes = b"",
    images: Sequence[ImageSpan] = (),
) -> list[bytes]:
    """Append the hashes of blocks that became full since ``hashes`` was computed (in place; returned)."""
    parent = hashes[-1] if hashes else ROOT_HASH
    return _chain(hashes, parent, token_ids, len(hashes) * block_size, block_size, extra, images)


def lora_extra(lora_name: str | None, lora_weights_id: str = "") -> bytes:
    """The ``extra`` of every block of a request run with LoRA adapter ``lora_name`` (b"" without
    one): an adapter changes every layer's keys and values, so its blocks are never the base
    model's nor another adapter's. The name is what clients and routers see; ``lora_weights_id``
    (a digest of the adapter's files, listed with the adapter in ``/v1/models``) keeps two
    different adapters loaded under one name, on two replicas or one after the other, apart."""
    if lora_name is None:
        return b""
    return b"lora\x00" + lora_name.encode() + b"\x00" + lora_weights_id.encode()


def salt_extra(cache_salt: str | None) -> bytes:
    """The ``extra`` a request's ``cache_salt`` (vLLM's field) adds to every block hash, after its
    adapter's (b"" without one): requests reuse each other's cached blocks only when they carry
    the same salt, so tenants given secret salts cannot probe each other's prompts by timing.
    The salt's digest, not the salt: a long salt costs one hash per request, not one per block."""
    if cache_salt is None:
        return b""
    return b"salt\x00" + hashlib.blake2b(cache_salt.encode(), digest_size=DIGEST_SIZE).digest()


def to_hex(hashes: Iterable[bytes]) -> list[str]:
    return [h.hex() for h in hashes]


def from_hex(hexes: Iterable[str]) -> list[bytes]:
    """Parse hex block hashes from the wire; raises ValueError on anything malformed."""
    out = []
    for s in hexes:
        if not isinstance(s, str) or len(s) != 2 * DIGEST_SIZE:
            raise ValueError(f"block hash must be {2 * DIGEST_SIZE} hex characters")
        out.append(bytes.fromhex(s))
    return out


def tier_key(fingerprint: str, block_hash: bytes) -> str:
    """Tier key of a block: ``ferry:kv:{model_fingerprint}:{hash_hex}``."""
    return f"{KEY_PREFIX}:{fingerprint}:{block_hash.hex()}"


def model_fingerprint(
    *,
    weights_id: str,
    dtype: str,
    block_size: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    tp_rank: int = 0,
    tp_size: int = 1,
    kv_layout: str = "k,v:[block,token,kv_head,dim]",
) -> str:
    """A short stable id of everything that changes a KV block's bytes.

    ``weights_id`` identifies the weights (e.g. a digest of the safetensors headers and
    sizes plus config.json). Two engines share tier entries only if every field agrees.
    """
    canon = json.dumps(
        {
            "hash_version": HASH_VERSION,
            "weights": weights_id,
            "dtype": dtype,
            "block_size": block_size,
            "num_layers": num_layers,
            "num_kv_heads": num_kv_heads,
            "head_dim": head_dim,
            "tp_rank": tp_rank,
            "tp_size": tp_size,
            "kv_layout": kv_layout,
        },
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.blake2b(canon.encode(), digest_size=8).hexdigest()
