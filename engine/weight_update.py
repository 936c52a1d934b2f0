"""Weight updates (SGLang's ``/update_weights_from_disk``, vLLM's ``reload_weights``): read a
checkpoint of the serving model's shape into host memory, checked, before the engine swaps it in.

``read_checkpoint`` runs on any thread (the async engine runs it in a worker thread, so neither the
event loop nor the engine loop waits on the disk) and touches no engine state; the engine installs
the result between steps (``LLMEngine.load_checkpoint``). A checkpoint of another architecture or
other shapes is a ``ValueError`` naming what differs, raised before anything changed, so the old
weights keep serving.

The new weights get their own identity: a digest of every byte of the checkpoint's files (at start
only samples of each tensor are read, ``weights_id``), since a trainer usually rewrites the same
directory with tensors of the same shapes, and a small learning rate may change few of a tensor's
elements. The model fingerprint that keys the KV tier follows it, so no block computed with the old
weights is ever read as the new ones'.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError

from engine.models.config import ModelConfig
from engine.models.loader import safetensors_files, weights_id
from engine.sleep_mode import check_load_format

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner

# ModelConfig fields a new checkpoint may change: the loader casts to the serving dtype anyway, and
# the stop tokens are fixed at start (as the tokenizer is).
_FREE_FIELDS = frozenset({"checkpoint_dtype", "eos_token_ids"})


@dataclass
class Checkpoint:
    """New weights read and checked, in host memory, waiting to be installed."""

    model_dir: Path
    weights: dict[str, torch.Tensor]
    weights_id: str
    # What the update changes in the speculative proposer (the MTP layer, built in host memory;
    # ``PagedDraft.read_update``), or None.
    draft_update: Any = None


Signature = dict[str, tuple[tuple[int, ...], torch.dtype]]


def weight_signature(weights: dict[str, torch.Tensor]) -> Signature:
    """Each loaded tensor's shape and dtype, by name: what a replacement must match."""
    return {name: (tuple(t.shape), t.dtype) for name, t in weights.items()}


def content_weights_id(model_dir: Path, hf_overrides: dict | None = None) -> str:
    """The sampled ``weights_id`` extended with a digest of every safetensors file's bytes."""
    h = hashlib.sha256(weights_id(model_dir, hf_overrides).encode())
    for path in safetensors_files(model_dir):
        with path.open("rb") as f:
            h.update(hashlib.file_digest(f, "sha256").digest())
    return h.hexdigest()[:32]


def resolve_checkpoint_dir(path: object) -> Path:
    if not isinstance(path, str) or not path:
        raise ValueError(f"model_path must be a non-empty string, got {path!r}")
    model_dir = Path(path).expanduser()
    if not model_dir.is_dir():
        raise ValueError(f"model_path {path!r} is not a directory")
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"model_path {path!r} has no config.json")
    safetensors_files(model_dir)  # ValueError if none
    return model_dir


def read_checkpoint(runner: ModelRunner, path: str, load_format: str | None = None) -> Checkpoint:
    """Read ``path`` as new weights for ``runner``'s model (ValueError if they cannot replace them)."""
    check_load_format(load_format)
    model_dir = resolve_checkpoint_dir(path)
    overrides = runner.config.hf_overrides
    try:
        new = ModelConfig.from_dir(model_dir, overrides)
    # ArithmeticError: a config whose numbers cannot shape a model (0 heads, 1e400 hidden units).
    except (ValueError, KeyError, TypeError, OSError, ArithmeticError) as e:
        raise ValueError(f"model_path {path!r}: its config.json cannot be read ({e!r})") from None
    old = runner.model_config
    changed = [
        f.name
        for f in fields(ModelConfig)
        if f.name not in _FREE_FIELDS and getattr(new, f.name) != getattr(old, f.name)
    ]
    if changed:
        detail = ", ".join(f"{n}: {getattr(old, n)!r} -> {getattr(new, n)!r}" for n in changed[:4])
        raise ValueError(
            f"model_path {path!r} holds another model than the one served (same architecture and "
            f"shapes required; {detail})"
        )
    try:
        weights = runner.read_weights(model_dir, torch.device("cpu"))
    except (ValueError, KeyError, OSError, SafetensorError) as e:  # a truncated or corrupt shard too
        raise ValueError(f"model_path {path!r}: its weights cannot be read ({e})") from None
    _check_signature(path, runner.weight_signature, weight_signature(weights))
    draft_update = runner.draft.read_update(model_dir) if runner.draft is not None else None
    return Checkpoint(model_dir, weights, content_weights_id(model_dir, overrides), draft_update)


def _check_signature(path: str, old: Signature, new: Signature) -> None:
    missing = sorted(old.keys() - new.keys())
    extra = sorted(new.keys() - old.keys())
    differ = sorted(n for n in old.keys() & new.keys() if old[n] != new[n])
    if not (missing or extra or differ):
        return
    parts = []
    if missing:
        parts.append(f"missing tensors {missing[:3]}")
    if extra:
        parts.append(f"unexpected tensors {extra[:3]}")
    for name in differ[:3]:
        parts.append(f"{name}: shape {list(old[name][0])} -> {list(new[name][0])}")
    raise ValueError(f"model_path {path!r} does not match the served model's weights ({'; '.join(parts)})")


def tensor_pairs(dst: Any, src: Any) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Each tensor of model object ``dst`` with its counterpart in ``src``, a model of the same class
    and config (``engine.models`` objects, their lists, tuples and dicts, torch modules by their
    parameters and buffers), or None where the two differ in structure, shape or dtype. A tensor ``dst`` holds
    in several places (tied embeddings) is listed once."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    return pairs if _pair(dst, src, pairs, set()) else None


def _pair(dst: Any, src: Any, out: list[tuple[torch.Tensor, torch.Tensor]], seen: set[int]) -> bool:
    if isinstance(dst, torch.Tensor):
        if not isinstance(src, torch.Tensor) or dst.shape != src.shape or dst.dtype != src.dtype:
            return False
        if id(dst) not in seen:
            seen.add(id(dst))
            out.append((dst, src))
        return True
    if isinstance(dst, torch.nn.Module):
        if not isinstance(src, torch.nn.Module):
            return False
        a, b = _module_tensors(dst), _module_tensors(src)
        return a.keys() == b.keys() and all(_pair(a[k], b[k], out, seen) for k in a)
    if isinstance(dst, (list, tuple)):
        return (
            type(src) is type(dst)
            and len(src) == len(dst)
            and all(_pair(x, y, out, seen) for x, y in zip(dst, src, strict=True))
        )
    if isinstance(dst, dict):
        return (
            isinstance(src, dict)
            and dst.keys() == src.keys()
            and all(_pair(dst[k], src[k], out, seen) for k in dst)
        )
    if type(dst).__module__.startswith("engine.models") and hasattr(dst, "__dict__"):
        if id(dst) in seen:
            return True
        seen.add(id(dst))
        if type(src) is not type(dst) or vars(dst).keys() != vars(src).keys():
            return False
        return all(_pair(v, vars(src)[k], out, seen) for k, v in vars(dst).items())
    return True  # configs, ops, numbers: no tensors to copy


def _module_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A torch module's parameters (as plain tensors) and buffers, non-persistent ones included."""
    out = {"p:" + name: p.data for name, p in module.named_parameters()}
    out.update({"b:" + name: b for name, b in module.named_buffers()})
    return out
