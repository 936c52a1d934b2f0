"""Plain helpers shared by engine tests (importable: tests/engine is on sys.path under pytest)."""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Any

MIXED_LENGTHS = [3, 9, 15, 16, 31, 100, 47, 64, 1, 77, 130, 18, 5, 33, 60, 90]


def mixed_prompts(vocab: int, seed: int = 7) -> list[list[int]]:
    """16 prompts of mixed lengths (index 5 has 100 tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in MIXED_LENGTHS]


def record_logits(llm: Any) -> dict[str, list[Any]]:
    """Every sampled row's raw logits from now on, by request id (a copy per row)."""
    seen: dict[str, list[Any]] = defaultdict(list)

    def observe(ids: list[str], logits: Any) -> None:
        for rid, row in zip(ids, logits, strict=True):
            seen[rid].append(row.clone())

    llm.engine.logits_observers.append(observe)
    return seen
