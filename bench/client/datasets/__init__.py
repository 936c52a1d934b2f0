"""Request sets behind a registry: a dataset turns the config (and a token source) into chains.

Adding a dataset is a new file with a ``build(ctx, count) -> list[Chain]`` function and one line
in ``DATASETS``. ``count`` chains are built: the first ``--warmup`` are the warm-up, the rest are
measured. Every random choice comes from ``ctx.rng`` (seeded by ``--seed``), so the same seed and
the same tokenizer give the same request set, byte for byte.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

from bench.client.datasets import jsonl, multi_turn, random_tokens, shared_prefix, sharegpt
from bench.client.datasets.common import DatasetContext
from bench.client.types import Chain

DATASETS: dict[str, Callable[[DatasetContext, int | None], list[Chain]]] = {
    "random": random_tokens.build,
    "shared-prefix": shared_prefix.build,
    "multi-turn": multi_turn.build,
    "jsonl": jsonl.build,
    "sharegpt": sharegpt.build,
}


def build_dataset(ctx: DatasetContext) -> list[Chain]:
    cfg = ctx.cfg
    measured = cfg.num_prompts
    count = None if measured is None else measured + cfg.warmup
    chains = DATASETS[cfg.dataset](ctx, count)
    if cfg.lora_modules:
        chains = spread_over_models(chains, cfg.lora_modules, cfg.seed)
    return chains


def spread_over_models(chains: list[Chain], models: tuple[str, ...], seed: int) -> list[Chain]:
    """Each chain (a request, or a whole conversation) naming one of ``models``, drawn from a
    generator of its own: the prompts are the same with or without ``--lora-modules``."""
    rng = random.Random(f"lora-modules/{seed}")
    out = []
    for chain in chains:
        model = rng.choice(models)
        out.append([dataclasses.replace(r, body={**r.body, "model": model}) for r in chain])
    return out


__all__ = ["DATASETS", "DatasetContext", "build_dataset"]
