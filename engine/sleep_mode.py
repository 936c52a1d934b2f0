"""Sleep mode (vLLM's ``--enable-sleep-mode``): what a sleeping engine has let go, and the moves.

An RL trainer colocated with the engine puts it to sleep to train in the memory it frees, then
wakes it, often with new weights (engine/weight_update.py). Level 1 releases the KV cache and moves
the weights to host memory; level 2 releases the KV cache and drops the weights (waking them reads
a checkpoint again, or takes new weights). ``wake_up`` restores ``weights`` and ``kv_cache``
separately, so a trainer can bring weights back, load new ones, and only then allocate the cache.

The engine is asleep until both are back: it runs no step, and the async engine holds new requests
until then (engine/async_engine.py). On a CPU device the weights already live in host memory, so
level 1 leaves them where they are and frees only the KV cache.

``EngineSleep`` (which ``LLMEngine`` inherits) does the engine's part between steps, with no
request running: it empties the prefix cache, has the KV connector let go of the cache, frees or
reallocates it, and offloads, drops, restores or replaces the weights; ordering that against
requests in flight is the async engine's (engine/async_sleep.py). This module is torch-free at
import (API server processes check levels and tags with it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from engine.weight_update import Checkpoint

logger = logging.getLogger(__name__)

SLEEP_LEVELS = (1, 2)
WAKE_TAGS = ("weights", "kv_cache")
# vLLM's pause modes for requests in flight when sleep is asked: abort them (default), wait until
# they finish, or keep them (preempted: they recompute when the engine wakes).
SLEEP_MODES = ("abort", "wait", "keep")
# Formats a weight update reads (vLLM's / SGLang's load_format names); None: auto.
UPDATE_LOAD_FORMATS = ("auto", "safetensors")
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


def check_load_format(load_format: str | None) -> None:
    """A weight update's ``load_format`` (engine/weight_update.py reads the checkpoint)."""
    if load_format is not None and load_format not in UPDATE_LOAD_FORMATS:
        raise ValueError(
            f"load_format {load_format!r} is not supported for a weight update; use "
            f"{' or '.join(UPDATE_LOAD_FORMATS)}"
        )


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


class EngineSleep:
    """``LLMEngine``'s sleep mode and weight updates (it inherits them), on the engine's thread,
    between steps. Uses its ``config``, ``model_runner``, ``block_manager``, ``scheduler``,
    ``connector``, ``model_info`` and ``sleep_state``."""

    sleep_state: SleepState
    model_info: Any

    @property
    def is_sleeping(self) -> bool:
        return self.sleep_state.is_sleeping

    def sleep(self, level: int) -> None:
        """Empty the prefix cache, free the KV cache, and offload (level 1) or discard (level 2) the
        weights. No request may be running (the async engine aborts, waits for or preempts them
        first); preempted requests left waiting recompute once the engine is awake."""
        if not self.config.enable_sleep_mode:
            raise ValueError("sleep mode is not enabled (start the engine with --enable-sleep-mode)")
        check_level(level)
        self._check_idle("sleep")
        state, runner = self.sleep_state, self.model_runner
        self.block_manager.reset_prefix_cache()
        if not state.kv_cache_released:
            self.connector.release_caches()
            runner.release_kv_cache()
            state.kv_cache_released = True
        if level == 2 and state.weights != DISCARDED:
            runner.discard_weights()
            state.weights = DISCARDED
        elif level == 1 and state.weights == AWAKE:
            runner.offload_weights()
            state.weights = OFFLOADED
        state.level = max(state.level, level)

    def wake_up(
        self, tags: list[str] | tuple[str, ...] | None = None, checkpoint: Checkpoint | None = None
    ) -> None:
        """Bring back the weights and / or the KV cache (``tags``; None: both). Discarded weights are
        read from the checkpoint again (``checkpoint``, if the caller read it off this thread)."""
        tags = check_tags(tags)
        state, runner = self.sleep_state, self.model_runner
        if "weights" in tags and state.weights != AWAKE:
            if state.weights == OFFLOADED:
                runner.restore_weights()
            else:
                self._install(checkpoint or self.read_checkpoint())
            state.weights = AWAKE
        if "kv_cache" in tags and state.kv_cache_released:
            runner.allocate_kv_cache()
            self.connector.bind_caches(runner.kv_caches)
            state.kv_cache_released = False
        if not state.is_sleeping:
            state.level = 0

    def read_checkpoint(self, path: str | None = None, load_format: str | None = None) -> Checkpoint:
        """Read new weights (None: the current checkpoint's directory again), checked against the
        served model; ValueError if they cannot replace it. Touches no engine state: any thread."""
        from engine.weight_update import read_checkpoint  # torch: not at this module's import

        runner = self.model_runner
        return read_checkpoint(runner, str(runner.model_dir) if path is None else path, load_format)

    def load_checkpoint(self, checkpoint: Checkpoint) -> None:
        """Serve new weights from now on (asleep or not; an offloaded copy is dropped). No request may
        be running: its KV would be the old weights'."""
        self._check_idle("update the weights")
        self._install(checkpoint)
        self.sleep_state.weights = AWAKE
        if not self.sleep_state.is_sleeping:
            self.sleep_state.level = 0

    def _install(self, checkpoint: Checkpoint) -> None:
        runner = self.model_runner
        # Serving weights are overwritten in place (one model on the device, not two at once);
        # offloaded or dropped ones are replaced by a model built on the device.
        in_place = self.sleep_state.weights == AWAKE and runner.replace_weights(checkpoint.weights)
        if not in_place:
            if self.sleep_state.weights == AWAKE:
                logger.warning("the new weights do not fit the serving model's tensors: built beside them")
            runner.install_weights(checkpoint.weights)
        if checkpoint.draft_update is not None:
            runner.draft.install_update(checkpoint.draft_update)
        runner.model_dir = checkpoint.model_dir
        # Cached KV (device prefix cache, partial blocks, what the tier was asked for) is the old
        # weights': dropped first, so its removal events go out under the old fingerprint.
        self.block_manager.reset_prefix_cache()
        self.scheduler.forget_tier_lookups()
        for request in self.requests.values():  # kept requests' encoded images: the old vision tower's
            request.image_features.clear()
        if checkpoint.weights_id != runner.weights_id:
            runner.set_weights_id(checkpoint.weights_id)
            self.connector.set_fingerprint(runner.model_fingerprint)
            self.model_info = replace(
                self.model_info, model_fingerprint=runner.model_fingerprint, weights_id=runner.weights_id
            )

    def _check_idle(self, what: str) -> None:
        if self.scheduler.running or self.scheduler.loading:
            raise RuntimeError(f"cannot {what} while requests are running")


def move_tensors(obj: Any, device: torch.device) -> Any:
    """Move every tensor a model object holds (attributes, lists, tuples, dicts, nested model
    objects of ``engine.models``, torch modules) to ``device``, in place; tensors shared between
    places stay shared. Returns ``obj`` (a tuple comes back rebuilt)."""
    return _move(obj, device, {})


def _move(obj: Any, device: torch.device, memo: dict[int, Any]) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        moved = memo.get(id(obj))
        if moved is None:
            moved = memo[id(obj)] = obj.to(device)
        return moved
    if isinstance(obj, torch.nn.Module):  # a part built by transformers (LLaVA's vision tower)
        return obj.to(device)
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
