"""How a pooling (embedding) request turns its prompt's hidden states into one vector.

``last`` (the last token's state: decoder embedders such as Qwen3-Embedding, gte-Qwen2, e5-mistral),
``mean`` (the average over every prompt token: GritLM-style models) or ``cls`` (the first token's).
``--pooling-type auto`` reads the model's sentence-transformers configuration (``modules.json``
naming a ``sentence_transformers.models.Pooling`` module, whose ``config.json`` sets
``pooling_mode_*``), as sentence-transformers itself would pool; without one, ``last``.

The vector is the final norm's output in fp32, not normalised: the server normalises (and
truncates to ``dimensions``) in ``engine/pooling.py``. ``mean`` and ``cls`` need the hidden state of
every prompt token (of the first, for ``cls``), so their requests skip the prefix cache.

``resolve_matryoshka`` decides once at load whether the model's embeddings may be cut to fewer
``dimensions`` (``Matryoshka``, carried to the server in ``ModelInfo.matryoshka``): vLLM's reading of
``config.json`` (``is_matryoshka``, ``matryoshka_dimensions``; ``--hf-overrides`` sets either), else
the same keys in the sentence-transformers ``config_sentence_transformers.json``. Torch-free.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

POOLING_TYPES = ("auto", "last", "mean", "cls")
_ST_MODES = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}


def needs_every_row(pooling_type: str) -> bool:
    return pooling_type in ("mean", "cls")


def resolve_pooling_type(requested: str, model_dir: Path) -> str:
    """``requested`` unless it is ``auto``: then the sentence-transformers pooling of ``model_dir``."""
    if requested != "auto":
        return requested
    try:
        modules = json.loads((model_dir / "modules.json").read_text())
    except (OSError, ValueError):
        return "last"
    for module in modules if isinstance(modules, list) else []:
        if not isinstance(module, dict) or not str(module.get("type", "")).endswith("models.Pooling"):
            continue
        try:
            cfg = json.loads((model_dir / str(module.get("path", "")) / "config.json").read_text())
        except (OSError, ValueError):
            logger.warning(
                "%s names a Pooling module without a readable config.json: last-token pooling", model_dir
            )
            return "last"
        chosen = [kind for key, kind in _ST_MODES.items() if cfg.get(key)]
        others = sorted(
            k for k, v in cfg.items() if k.startswith("pooling_mode_") and v and k not in _ST_MODES
        )
        if len(chosen) == 1 and not others:
            return chosen[0]
        logger.warning(
            "%s pools by %s, which ferry does not: last-token pooling (set --pooling-type to choose)",
            model_dir,
            ", ".join([*(k for k in _ST_MODES if cfg.get(k)), *others]) or "nothing",
        )
        return "last"
    return "last"


@dataclass(frozen=True)
class Matryoshka:
    """A Matryoshka embedding model: a prefix of its vector is an embedding of its own."""

    dimensions: tuple[int, ...] | None = None  # the only sizes allowed; None: any, up to the hidden size


def resolve_matryoshka(model_config: Any, model_dir: Path) -> Matryoshka | None:
    """The model's ``Matryoshka`` facts, None when it is not one (``dimensions`` is then refused):
    ``model_config`` (``engine.models.config.ModelConfig``: config.json with ``--hf-overrides``)
    first; a config.json that says nothing defers to the sentence-transformers config."""
    if model_config.is_matryoshka:
        return Matryoshka(model_config.matryoshka_dimensions)
    try:
        st = json.loads((model_dir / "config_sentence_transformers.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(st, dict):
        return None
    from engine.models.config import matryoshka_dimensions

    dims = matryoshka_dimensions(st.get("matryoshka_dimensions"))
    if dims is None and st.get("is_matryoshka") is not True:
        return None
    return Matryoshka(dims)
