"""Plain helpers shared by engine tests (importable: tests/engine is on sys.path under pytest)."""

from __future__ import annotations

import random

MIXED_LENGTHS = [3, 9, 15, 16, 31, 100, 47, 64, 1, 77, 130, 18, 5, 33, 60, 90]


def mixed_prompts(vocab: int, seed: int = 7) -> list[list[int]]:
    """16 prompts of mixed lengths (index 5 has 100 tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in MIXED_LENGTHS]
