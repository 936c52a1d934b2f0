"""vLLM's ``--load-format dummy``: random weights of the checkpoint's shapes, no weight file read.

For benchmarks and smoke tests of a model whose weights are not at hand: the directory needs its
``config.json`` (and a tokenizer) only. Tensor names and shapes come from the architecture's own
transformers class, built on the ``meta`` device (no memory, no initialisation); the values are
drawn as vLLM draws them, uniform in [-1e-3, 1e-3], from a fixed seed, so every replica and every
run holds the same weights. What the model answers is meaningless but costs what real weights cost.

Never read here: ``*.safetensors``. A quantized checkpoint's config gets the unquantized shapes (the
model dtype), as ferry holds dequantized weights anyway.
"""

from __future__ import annotations

from typing import Any

import torch

_LOW, _HIGH = -1e-3, 1e-3
_SEED = 1234


def dummy_weights(
    raw_config: dict[str, Any],
    dtype: torch.dtype,
    device: torch.device,
    keep_fp32: tuple[str, ...] = (),
    renames: tuple[tuple[str, str], ...] = (),
) -> dict[str, torch.Tensor]:
    """Every floating-point tensor of the architecture's state dict, renamed as the loader renames a
    checkpoint's (``renames``: name prefixes), random in ``dtype`` (fp32 for ``keep_fp32`` names)."""
    from engine.models.loader import _rename

    generator = torch.Generator().manual_seed(_SEED)
    out: dict[str, torch.Tensor] = {}
    for stored, meta in _meta_state_dict(raw_config).items():
        name = _rename(stored, renames)
        if name is None or not meta.dtype.is_floating_point:
            continue
        target = torch.float32 if name.endswith(keep_fp32) else dtype
        values = torch.empty(meta.shape, dtype=torch.float32).uniform_(_LOW, _HIGH, generator=generator)
        out[name] = values.to(device=device, dtype=target)
    return out


def _meta_state_dict(raw: dict[str, Any]) -> dict[str, torch.Tensor]:
    import transformers

    architecture = (raw.get("architectures") or ["?"])[0]
    cls = getattr(transformers, architecture, None)
    if cls is None:
        raise ValueError(
            f"--load-format dummy: transformers has no {architecture} class to take the weight shapes from"
        )
    fields = {k: v for k, v in raw.items() if k not in ("quantization_config", "model_type")}
    try:
        config = transformers.AutoConfig.for_model(raw.get("model_type", ""), **fields)
        with torch.device("meta"):
            model = cls(config)
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"--load-format dummy: cannot build {architecture} from config.json ({e})") from None
    return model.state_dict()
