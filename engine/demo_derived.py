"""Checkpoints made from another one: a draft cut from its first layers (speculative decoding), a
copy with a DeepSeek-V3-style MTP layer appended, and a random LoRA adapter in PEFT's format. Torch
is imported only when called.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path


def build_layer_draft(out_dir: str | os.PathLike, model_dir: str | os.PathLike, num_layers: int) -> Path:
    """A draft model for speculative decoding cut from a decoder-only checkpoint: its first
    ``num_layers`` layers with its embeddings, final norm and head (same vocabulary, config
    otherwise unchanged). It agrees with the whole model on some tokens, as a smaller model would."""
    from safetensors.torch import load_file, save_file

    src, out = Path(model_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    keep = {}
    for shard in sorted(src.glob("*.safetensors")):
        for name, tensor in load_file(shard).items():
            parts = name.split(".")
            layer = parts[parts.index("layers") + 1] if "layers" in parts else None
            if layer is None or int(layer) < num_layers:
                keep[name] = tensor
    save_file(keep, out / "model.safetensors")
    return out


def add_mtp_layer(
    out_dir: str | os.PathLike, model_dir: str | os.PathLike, *, seed: int = 0, own_head: bool = True
) -> Path:
    """A copy of a DeepSeek-V3-style checkpoint with a multi-token-prediction layer appended, as
    DeepSeek-V3's own (transformers has none to build): ``model.layers.{N}`` (N =
    ``num_hidden_layers``) with ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and a decoder
    layer of the last one's shapes and names, random (norms and the router's bias copied), and
    ``num_nextn_predict_layers: 1`` in config.json. ``own_head``: the layer also holds
    ``embed_tokens`` and ``shared_head.head`` (copies of the target's, as DeepSeek-V3 ships them);
    else the target's are used."""
    import torch
    from safetensors.torch import load_file, save_file

    src, out = Path(model_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    for path in src.iterdir():
        if path.suffix != ".safetensors" and path.is_file():
            (out / path.name).write_bytes(path.read_bytes())
    (out / "config.json").write_text(json.dumps(config, indent=2))
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(src.glob("*.safetensors")):
        weights.update(load_file(shard))
    n, hidden = config["num_hidden_layers"], config["hidden_size"]
    g = torch.Generator().manual_seed(seed)
    dtype = weights["model.embed_tokens.weight"].dtype

    def rand(shape: Sequence[int], std: float) -> torch.Tensor:
        return (torch.randn(tuple(shape), generator=g) * std).to(dtype)

    last, new = f"model.layers.{n - 1}.", f"model.layers.{n}."
    for name, t in list(weights.items()):
        if name.startswith(last):
            kept = name.endswith(("norm.weight", "e_score_correction_bias"))
            weights[new + name[len(last) :]] = t.clone() if kept else rand(t.shape, float(t.float().std()))
    weights[new + "enorm.weight"] = torch.ones(hidden, dtype=dtype)
    weights[new + "hnorm.weight"] = torch.ones(hidden, dtype=dtype)
    weights[new + "shared_head.norm.weight"] = torch.ones(hidden, dtype=dtype)
    weights[new + "eh_proj.weight"] = rand((hidden, 2 * hidden), (2 * hidden) ** -0.5)
    if own_head:
        weights[new + "embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
        weights[new + "shared_head.head.weight"] = weights["lm_head.weight"].clone()
    save_file(weights, out / "model.safetensors")
    return out


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_lora_adapter(
    out_dir: str | os.PathLike,
    model_dir: str | os.PathLike,
    *,
    seed: int = 0,
    rank: int = 8,
    alpha: float = 16.0,
    targets: Sequence[str] = LORA_TARGETS,
    use_rslora: bool = False,
    std: float = 0.05,
) -> Path:
    """Write a random LoRA adapter for the model at ``model_dir`` in PEFT's format
    (``adapter_config.json`` + ``adapter_model.safetensors``). Unlike a freshly initialised PEFT
    adapter (``B = 0``), both matrices are random, so it changes what the model says. Targets
    are PEFT module names; those a layer does not have (an MoE layer's MLP) are skipped."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    model_dir, out = Path(model_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shapes[name] = tuple(f.get_slice(name).get_shape())
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in sorted(shapes.items()):
        # model.layers.N.{self_attn|mlp}.<module>.weight (a vision checkpoint's language model nests it
        # under language_model.): experts and shared experts are deeper
        parts = [part for part in name.split(".") if part != "language_model"]
        if len(parts) != 6 or parts[1] != "layers" or parts[4] not in targets or parts[5] != "weight":
            continue
        fan_out, fan_in = shape
        key = "base_model.model." + name.removesuffix(".weight")
        tensors[key + ".lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * std
        tensors[key + ".lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * std
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(set(targets)),
        "bias": "none",
        "use_rslora": use_rslora,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out
