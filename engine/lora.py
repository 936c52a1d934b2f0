"""LoRA adapters: PEFT checkpoints read and checked against the model, the cache of loaded
adapters, and each step's batch, from which the model's projections add their low-rank updates.

An adapter is a directory as PEFT saves it: ``adapter_config.json`` (``r``, ``lora_alpha``,
``use_rslora``, ``alpha_pattern``…) and ``adapter_model.safetensors`` with
``…layers.{i}.{self_attn|mlp|feed_forward}.{module}.lora_A.weight`` (``[r, in]``) and ``….lora_B.weight``
(``[out, r]``). A module's update is ``B @ A @ x * scale``, ``scale = alpha / r`` (``alpha / √r``
with rsLoRA). What ferry cannot apply exactly is refused at load, by name: DoRA, trained biases,
``modules_to_save``, embeddings or the LM head, experts of a mixture-of-experts layer, a rank
above ``max_lora_rank``.

The model fuses q/k/v and gate/up into one matmul each, so an adapter is kept the same way: per
layer and fused group (``qkv``, ``o``, ``gate_up``, ``down``) one ``A`` (the modules' ``A``s stacked,
``[R, in]``) and one ``B`` (``[out, R]``, each module's ``B`` times its scale in its own rows and
columns, zeros elsewhere). A step's rows that run one adapter then take two matmuls per group.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.lora_request import NO_ADAPTER, LoRARequest
from kvcache.keys import lora_extra

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
GROUPS = ("qkv", "o", "gate_up", "down")

# A projection an adapter may target: its fused group, its first output row there, in and out sizes.
ModuleSlot = tuple[str, int, int, int]
Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]

# OPT's layers sit under ``model.decoder.``; a vision-language checkpoint's language model (served
# text-only) nests its layers under ``model.language_model.`` (transformers 5) or ``language_model.model.``
# (transformers 4).
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:language_model\.)?(?:model\.)?(?:language_model\.|decoder\.)?layers\.(\d+)\."
    r"(self_attn|mlp|feed_forward|block_sparse_moe)\."  # feed_forward: Llama 4's MLP
    r"([A-Za-z0-9_.]+?)\.lora_([AB])\.weight$"
)


@dataclass(frozen=True)
class LoRAAdapter:
    name: str
    path: str
    weights_id: str  # digest of the adapter's files (its block-hash salt with the name)
    # Per layer: fused group -> (A [R, in], B [out, R] with the scales folded in).
    layers: tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], ...]

    @property
    def block_extra(self) -> bytes:
        return lora_extra(self.name, self.weights_id)

    def to(self, device: torch.device) -> LoRAAdapter:
        layers = tuple(
            {g: (a.to(device), b.to(device)) for g, (a, b) in layer.items()} for layer in self.layers
        )
        return LoRAAdapter(self.name, self.path, self.weights_id, layers)


def adapter_weights_id(path: Path) -> str:
    """The digest of the adapter at ``path`` (``_digest`` of its two files)."""
    return _digest((path / ADAPTER_CONFIG).read_bytes(), (path / ADAPTER_WEIGHTS).read_bytes())


def _digest(config: bytes, weights: bytes) -> str:
    """A digest of ``adapter_config.json`` and all of ``adapter_model.safetensors``: adapters are
    small enough to hash whole, and two of one shape differ only in their values."""
    h = hashlib.blake2b(digest_size=16)
    h.update(config)
    h.update(b"\0")
    h.update(hashlib.blake2b(weights, digest_size=16).digest())
    return h.hexdigest()


def load_adapter(
    request: LoRARequest, layouts: Sequence[dict[str, ModuleSlot]], *, max_rank: int, dtype: torch.dtype
) -> LoRAAdapter:
    """Read and check the adapter at ``request.lora_path`` against the model's ``layouts`` (per
    layer: module name -> slot; ``LlamaForCausalLM.lora_layout``). Raises ValueError saying what
    is wrong with it; the adapter is on the CPU, in ``dtype``."""
    path = Path(request.lora_path).expanduser()
    where = f"LoRA adapter {request.lora_name!r} ({request.lora_path})"
    if not path.is_dir():
        raise ValueError(f"{where}: {NO_ADAPTER} (no such directory)")
    if not (path / ADAPTER_CONFIG).is_file():
        raise ValueError(f"{where}: {NO_ADAPTER} (no {ADAPTER_CONFIG})")
    if not (path / ADAPTER_WEIGHTS).is_file():
        other = (
            " (only .bin weights, which ferry does not unpickle)"
            if (path / "adapter_model.bin").exists()
            else ""
        )
        raise ValueError(f"{where}: no {ADAPTER_WEIGHTS}{other}")
    try:
        config_bytes = (path / ADAPTER_CONFIG).read_bytes()
        config = json.loads(config_bytes)
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: {ADAPTER_CONFIG} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{where}: {ADAPTER_CONFIG} is not a JSON object")
    _check_config(config, where)
    from safetensors import SafetensorError
    from safetensors.torch import load as load_safetensors

    weights_bytes = (path / ADAPTER_WEIGHTS).read_bytes()  # read once: parsed and hashed
    try:
        stored = load_safetensors(weights_bytes)
    except SafetensorError as e:
        raise ValueError(f"{where}: {ADAPTER_WEIGHTS} is not a valid safetensors file ({e})") from None
    tensors: dict[tuple[int, str, str], torch.Tensor] = {}
    for key, tensor in stored.items():
        m = _KEY.match(key)
        if m is None:
            raise ValueError(f"{where}: {key} is not a LoRA weight ferry can apply ({_why(key)})")
        layer, block, module, ab = int(m[1]), m[2], m[3], m[4]
        tensors[(layer, f"{block}.{module}", ab)] = tensor.float()
    if not tensors:
        raise ValueError(f"{where}: {ADAPTER_WEIGHTS} holds no LoRA weights")
    modules: dict[int, dict[str, tuple[ModuleSlot, torch.Tensor, torch.Tensor]]] = {}
    for (layer, full, ab), tensor in sorted(tensors.items()):
        if ab == "B":
            continue
        name = f"model.layers.{layer}.{full}"
        b = tensors.get((layer, full, "B"))
        if b is None:
            raise ValueError(f"{where}: {name} has lora_A but no lora_B")
        module = full.split(".", 1)[1]
        if layer >= len(layouts):
            raise ValueError(f"{where}: {name}: the model has {len(layouts)} layers")
        slot = layouts[layer].get(module)
        if slot is None:
            raise ValueError(f"{where}: {name}: {_no_slot(full, layouts[layer])}")
        _, _, fan_in, fan_out = slot
        r = tensor.shape[0] if tensor.dim() == 2 else -1  # a scalar or a vector has no rank
        if r < 1 or b.dim() != 2 or tensor.shape[1] != fan_in or tuple(b.shape) != (fan_out, r):
            raise ValueError(
                f"{where}: {name} has lora_A {tuple(tensor.shape)} and lora_B {tuple(b.shape)}; this model "
                f"needs [r, {fan_in}] and [{fan_out}, r] with r >= 1"
            )
        if r > max_rank:
            raise ValueError(f"{where}: {name} has rank {r}, more than max_lora_rank={max_rank}")
        modules.setdefault(layer, {})[module] = (slot, tensor, b * _scale(config, name, r))
    for layer, full, ab in tensors:
        if ab == "B" and (layer, full, "A") not in tensors:
            raise ValueError(f"{where}: model.layers.{layer}.{full} has lora_B but no lora_A")
    layers = tuple(_fuse(modules.get(i, {}), layouts[i], dtype) for i in range(len(layouts)))
    return LoRAAdapter(request.lora_name, str(path), _digest(config_bytes, weights_bytes), layers)


def _check_config(config: dict[str, Any], where: str) -> None:
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"{where}: peft_type {peft_type!r} is not LoRA")
    refused = {
        "use_dora": "DoRA adapters are not supported",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D) weights are not supported",
        "modules_to_save": "modules_to_save (fully trained modules) are not supported",
    }
    for key, why in refused.items():
        if config.get(key):
            raise ValueError(f"{where}: {why} ({key}={config[key]!r})")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{where}: trained biases are not supported (bias={config['bias']!r})")
    _check_alpha(config.get("lora_alpha", 8), f"{where}: lora_alpha")
    for key in ("alpha_pattern", "rank_pattern"):
        if not isinstance(config.get(key) or {}, dict):
            raise ValueError(f"{where}: {key} must be an object")
    for pattern, alpha in (config.get("alpha_pattern") or {}).items():
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(
                f"{where}: alpha_pattern key {pattern!r} is not a regular expression ({e})"
            ) from None
        _check_alpha(alpha, f"{where}: alpha_pattern[{pattern!r}]")


def _check_alpha(alpha: object, what: str) -> None:
    # Python's json reads NaN, Infinity and 1e400 (and integers past any float): such a scale would
    # make every output NaN.
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(_as_float(alpha)):
        raise ValueError(f"{what} must be a finite number, got {alpha!r}")


def _as_float(x: float) -> float:
    try:
        return float(x)
    except OverflowError:
        return math.inf


def _scale(config: dict[str, Any], name: str, rank: int) -> float:
    """``alpha / r`` (rsLoRA: ``alpha / √r``), with ``alpha_pattern``'s alpha for a matching module
    (PEFT's rule: the pattern matches the module's whole name or a dotted suffix of it)."""
    alpha = config.get("lora_alpha", 8)
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", name):
            alpha = value
            break
    return float(alpha) / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _fuse(
    modules: dict[str, tuple[ModuleSlot, torch.Tensor, torch.Tensor]],
    layout: dict[str, ModuleSlot],
    dtype: torch.dtype,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """One (A, B) per fused group: A's stacked, each B in its own output rows and rank columns."""
    fused: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for group in GROUPS:
        members = [(slot, a, b) for slot, a, b in modules.values() if slot[0] == group]
        if not members:
            continue
        width = max(slot[1] + slot[3] for slot in layout.values() if slot[0] == group)
        rank = sum(a.shape[0] for _, a, _ in members)
        b_full = torch.zeros(width, rank)
        col = 0
        for (_, offset, _, fan_out), a, b in members:
            b_full[offset : offset + fan_out, col : col + a.shape[0]] = b
            col += a.shape[0]
        a_full = torch.cat([a for _, a, _ in members])
        fused[group] = (a_full.to(dtype).contiguous(), b_full.to(dtype).contiguous())
    return fused


def _why(key: str) -> str:
    if "lora_magnitude_vector" in key:
        return "DoRA is not supported"
    if "embed" in key or "lm_head" in key:
        return "LoRA on embeddings or the LM head is not supported"
    if key.endswith(".bias"):
        return "trained biases are not supported"
    return "expected …layers.N.self_attn|mlp.<module>.lora_A|lora_B.weight"


def _no_slot(full: str, layout: dict[str, ModuleSlot]) -> str:
    block, module = full.split(".", 1)
    if block == "block_sparse_moe" or (
        block in ("mlp", "feed_forward") and not any(s[0] == "gate_up" for s in layout.values())
    ):
        return "LoRA on a mixture-of-experts layer is not supported"
    return f"no projection {module!r} takes LoRA here (these do: {', '.join(sorted(layout))})"


class LoRACache:
    """Loaded adapters by name, least recently used first out past ``capacity`` (vLLM's
    ``max_cpu_loras``). Requests hold their adapter object, so evicting one never affects a request
    that runs with it; the next request that names it loads it again."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._adapters: OrderedDict[str, LoRAAdapter] = OrderedDict()

    def get(self, name: str) -> LoRAAdapter | None:
        adapter = self._adapters.get(name)
        if adapter is not None:
            self._adapters.move_to_end(name)
        return adapter

    def put(self, adapter: LoRAAdapter) -> None:
        self._adapters[adapter.name] = adapter
        self._adapters.move_to_end(adapter.name)
        while len(self._adapters) > self.capacity:
            self._adapters.popitem(last=False)

    def pop(self, name: str) -> LoRAAdapter | None:
        return self._adapters.pop(name, None)

    def __contains__(self, name: str) -> bool:
        return name in self._adapters


class LoRABatch:
    """One step's adapters: for each, the rows of the flattened batch that run it (None: every row)."""

    def __init__(self, parts: list[tuple[torch.Tensor | None, LoRAAdapter]], linear: Linear) -> None:
        self.parts = parts
        self.linear = linear

    def add(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (the base projection of ``x``, updated in place) plus each adapter's update on its rows."""
        linear = self.linear
        for rows, adapter in self.parts:
            ab = adapter.layers[layer].get(group)
            if ab is None:
                continue
            a, b = ab
            if rows is None:
                out.add_(linear(linear(x, a, None), b, None))
            else:
                out.index_add_(0, rows, linear(linear(x.index_select(0, rows), a, None), b, None))
        return out


class DeviceAdapters:
    """The adapters on the model's device: at most ``capacity`` (``max_loras``; the scheduler never
    runs more in one step), the least recently used copy dropped first."""

    def __init__(self, device: torch.device, capacity: int) -> None:
        self.device = device
        self.capacity = capacity
        self._copies: OrderedDict[int, tuple[LoRAAdapter, LoRAAdapter]] = OrderedDict()

    def batch(
        self, row_adapters: list[tuple[int, int, LoRAAdapter | None]], linear: Linear
    ) -> LoRABatch | None:
        """The step's ``LoRABatch`` from each request's (first row, rows, adapter); None when no row
        runs an adapter."""
        by_adapter: dict[int, tuple[LoRAAdapter, list[int]]] = {}
        total = 0
        for first, n, adapter in row_adapters:
            total += n
            if adapter is not None:
                by_adapter.setdefault(id(adapter), (adapter, []))[1].extend(range(first, first + n))
        if not by_adapter:
            return None
        parts: list[tuple[torch.Tensor | None, LoRAAdapter]] = []
        for adapter, rows in by_adapter.values():
            on_device = self._on_device(adapter, set(by_adapter))
            if len(rows) == total:
                parts.append((None, on_device))
            else:
                parts.append((torch.tensor(rows, dtype=torch.long, device=self.device), on_device))
        return LoRABatch(parts, linear)

    def clear(self) -> None:
        """Drop every device copy (sleep mode lets the device's memory go; the next step that runs
        an adapter copies it again from host memory)."""
        self._copies.clear()

    @property
    def num_copies(self) -> int:
        return len(self._copies)

    def _on_device(self, adapter: LoRAAdapter, needed: set[int]) -> LoRAAdapter:
        if self.device.type == "cpu":
            return adapter
        key = id(adapter)
        held = self._copies.get(key)
        if held is not None:
            self._copies.move_to_end(key)
            return held[1]
        for other in list(self._copies):
            if len(self._copies) < self.capacity:
                break
            if other not in needed:
                del self._copies[other]
        copy = adapter.to(self.device)
        # The source adapter is kept with its copy: its id stays unique while the copy lives.
        self._copies[key] = (adapter, copy)
        return copy
