"""How a pooling (embedding) request turns its prompt's hidden states into one vector.

``last`` (the last token's state: decoder embedders such as Qwen3-Embedding, gte-Qwen2, e5-mistral),
``mean`` (the average over every prompt token: GritLM-style models) or ``cls`` (the first token's).
``--pooling-type auto`` reads the model's sentence-transformers configuration (``modules.json``
naming a ``sentence_transformers.models.Pooling`` module, whose ``config.json`` sets
``pooling_mode_*``), as sentence-transformers itself would pool; without one, ``last``.

The vector is the final norm's output in fp32, not normalised: the server normalises (and
truncates to ``dimensions``) in ``engine/pooling.py``. ``mean`` and ``cls`` need the hidden state of
every prompt token (of the first, for ``cls``), so their requests skip the prefix cache.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

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
