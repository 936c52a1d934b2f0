"""vLLM's ``PoolingParams`` for the offline pooling APIs (``LLM.embed``, ``classify``, ``score`` and
``encode``: engine/llm_pooling.py): what is done to a prompt's pooled state before it is handed
back. Torch-free, as ``SamplingParams``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PoolingParams:
    """``dimensions``: an embedding keeps its first N values (Matryoshka models only, as vLLM
    allows), before it is normalised. ``normalize``: an embedding is L2-normalised (None: yes, vLLM's
    default; False: the pooled hidden state as the model left it). ``use_activation``: a classifier's
    probabilities and a cross-encoder's scores go through the activation its config names (None:
    yes; False: the score head's logits). ``truncate_prompt_tokens``: keep only a prompt's last N
    tokens (-1: the model's context length)."""

    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    truncate_prompt_tokens: int | None = None
