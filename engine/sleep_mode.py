"""Sleep mode (vLLM's ``--enable-sleep-mode``): what a sleeping engine has let go, and the moves.

An RL trainer colocated with the engine puts it to sleep to train in the memory it frees, then
wakes it, often with new weights (engine/weight_update.py). Level 1 releases the KV cache and moves
the weights to host memory; level 2 releases the KV cache and drops the weights (waking them reads
a checkpoint again, or takes new weights). ``wake_up`` restores ``weights`` and ``kv_cache``
separately, so a trainer can bring weights back, load new ones, and only then allocate the cache.

The engine is asleep until both are back: it runs no step, and the async engine holds new requests
until then (engine/async_engine.py). On a CPU device the weights already live in host memory, so
level 1 leaves them where they are and frees only the KV cache.

This module only moves tensors and tracks state; it never schedules or touches blocks. It is
torch-free at import (API server processes check levels and tags with it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

SLEEP_LEVELS = (1, 2)
WAKE_TAGS = ("weights", "kv_cache")
# vLLM's pause modes for requests in flight when sleep is asked: abort them (default), wait until
# they finish, or keep them (preempted: they recompute when the engine wakes).
SLEEP_MODES = ("abort", "wait", "keep")
# Weight states
AWAKE, OFFLOADED, DISCARDED = "awake", "offloaded", "discarded"


@dataclass
class SleepState:
    """What the engine let go: ``weights`` is awake, offloaded (level 1) or discarded (level 2);
    ``kv_cache`` is held or released. ``level`` is the deepest sleep since the last full wake."""

    weights: str = AWAKE
    kv_cache_released: bool = False
    level: int = 0

    @property
    def is_sleeping(self) -> bool:
        """vLLM's ``is_sleeping``: True until every part is awake."""
        return self.weights != AWAKE or self.kv_cache_released


def check_level(level: object) -> int:
    if isinstance(level, bool) or not isinstance(level, int) or level not in SLEEP_LEVELS:
        raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
    return level


def check_mode(mode: object) -> str:
    if mode not in SLEEP_MODES:
        raise ValueError(f"sleep mode must be one of {', '.join(SLEEP_MODES)}, got {mode!r}")
    return mode  # type: ignore[return-value]


def check_tags(tags: object) -> tuple[str, ...]:
    """``None`` -> every part; else a non-empty list of ``weights`` / ``kv_cache``."""
    if tags is None:
        return WAKE_TAGS
    if isinstance(tags, str) or not isinstance(tags, (list, tuple)) or not tags:
        raise ValueError(f"wake_up tags must be a non-empty list of {', '.join(WAKE_TAGS)}, got {tags!r}")
    bad = [t for t in tags if t not in WAKE_TAGS]
    if bad:
        raise ValueError(f"unknown wake_up tag(s) {bad!r}; known: {', '.join(WAKE_TAGS)}")
    return tuple(dict.fromkeys(tags))


def move_tensors(obj: Any, device: torch.device) -> Any:
    """Move every tensor a model object holds (attributes, lists, tuples, dicts, nested model
    objects of ``engine.models``) to ``device``, in place; tensors shared between places stay
    shared. Returns ``obj`` (a tuple comes back rebuilt)."""
    return _move(obj, device, {})


def _move(obj: Any, device: torch.device, memo: dict[int, Any]) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        moved = memo.get(id(obj))
        if moved is None:
            moved = memo[id(obj)] = obj.to(device)
        return moved
    if isinstance(obj, list):
        obj[:] = [_move(x, device, memo) for x in obj]
    elif isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        moved_items = [_move(x, device, memo) for x in obj]
        if any(a is not b for a, b in zip(moved_items, obj, strict=True)):
            return tuple(moved_items)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            obj[k] = _move(v, device, memo)
    elif type(obj).__module__.startswith("engine.models") and hasattr(obj, "__dict__"):
        if id(obj) in memo:
            return obj
        memo[id(obj)] = obj
        for k, v in list(vars(obj).items()):
            new = _move(v, device, memo)
            if new is not v:  # (frozen config dataclasses hold no tensors and are left as they are)
                setattr(obj, k, new)
    return obj
