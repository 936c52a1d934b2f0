"""The model creator's default sampling parameters, from ``generation_config.json`` (vLLM's
``--generation-config`` and ``--override-generation-config``).

A request that leaves ``temperature``, ``top_p``, ``top_k``, ``min_p`` or ``repetition_penalty``
unset gets the model's value instead of the neutral one, and ``max_new_tokens`` caps every
request's ``max_tokens``, as vLLM serves them. Qwen models, for one, ship
``temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.05``.

Sources (``generation_config``): ``auto``, the model directory's file; ``vllm``, none (neutral
defaults); any other value, a directory holding a ``generation_config.json``. The overrides are
applied on top of any of them. As vLLM reads the file through transformers' ``to_diff_dict``, a
value equal to transformers' own default (``top_k: 50``, ``temperature: 1.0`` ...) is not a
default: the neutral value stays.

Torch-free: API server processes read the result from ``ModelInfo``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.sampling_params import SamplingParams

log = logging.getLogger("ferry.engine")

FILE_NAME = "generation_config.json"

# The keys read, with transformers' GenerationConfig defaults (a value equal to one is no default).
TRANSFORMERS_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 50,
    "min_p": None,
    "repetition_penalty": 1.0,
    "max_new_tokens": None,
}


def load_generation_defaults(
    model_dir: Path | str | None, source: str = "auto", overrides: Mapping[str, Any] | str | None = None
) -> dict[str, Any]:
    """The default sampling values requests get, keyed as SamplingParams fields (``max_new_tokens``
    becomes ``max_tokens``). ValueError, naming the key and where it came from, for a value no
    request could run with."""
    if source == "vllm":
        config: dict[str, Any] = {}
        origin = "--override-generation-config"
    else:
        directory = Path(model_dir) if source == "auto" and model_dir is not None else Path(source)
        if source != "auto" and not (directory / FILE_NAME).is_file():
            raise ValueError(f"--generation-config {source}: no {FILE_NAME} in that directory")
        config = _diff(_read(directory / FILE_NAME))
        origin = str(directory / FILE_NAME)
    extra = parse_overrides(overrides)
    config.update(extra)
    defaults: dict[str, Any] = {}
    for key in TRANSFORMERS_DEFAULTS:
        value = config.get(key)
        if value is not None:
            defaults["max_tokens" if key == "max_new_tokens" else key] = value
    where = "--override-generation-config" if set(extra) & set(TRANSFORMERS_DEFAULTS) else origin
    _check(defaults, where)
    if defaults:
        log.info(
            "default sampling parameters from %s: %s (--generation-config vllm keeps the neutral ones)",
            origin,
            ", ".join(f"{k}={v}" for k, v in sorted(defaults.items())),
        )
    return defaults


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def _diff(config: dict[str, Any]) -> dict[str, Any]:
    """The file's values that differ from transformers' defaults (what ``to_diff_dict`` keeps)."""
    return {
        k: v for k, v in config.items() if k not in TRANSFORMERS_DEFAULTS or v != TRANSFORMERS_DEFAULTS[k]
    }


def parse_overrides(overrides: Mapping[str, Any] | str | None) -> dict[str, Any]:
    if overrides is None:
        return {}
    if isinstance(overrides, str):
        try:
            overrides = json.loads(overrides)
        except ValueError as e:
            raise ValueError(f"--override-generation-config is not valid JSON: {e}") from e
    if not isinstance(overrides, Mapping):
        raise ValueError("--override-generation-config must be a JSON object")
    unknown = sorted(set(overrides) - set(TRANSFORMERS_DEFAULTS))
    if unknown:
        raise ValueError(
            f"--override-generation-config: unknown key(s) {', '.join(unknown)}; "
            f"known: {', '.join(TRANSFORMERS_DEFAULTS)}"
        )
    return dict(overrides)


def _check(defaults: dict[str, Any], where: str) -> None:
    """Each value must be one a request could give (so no request fails on a default)."""
    for key, value in defaults.items():
        kind = int if key in ("top_k", "max_tokens") else (int, float)
        if isinstance(value, bool) or not isinstance(value, kind):
            raise ValueError(f"{where}: {key} must be a number, got {value!r}")
    try:
        SamplingParams(**defaults).validate()
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from e
