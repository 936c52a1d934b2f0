"""ferry's inference engine.

``from engine import LLM, SamplingParams`` is the offline API. Heavy names (anything that
imports torch) load lazily, so torch-free modules of this package (tokenizer, sampling
params, outputs) can be imported by the router without pulling torch in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from engine.llm_prompts import TextPrompt, TokensPrompt
from engine.lora_request import LoRARequest
from engine.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine
    from engine.llm import LLM

__all__ = [
    "LLM",
    "AsyncEngine",
    "SamplingParams",
    "StructuredOutputsParams",
    "PoolingParams",
    "TextPrompt",
    "TokensPrompt",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "LoRARequest",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "ScoringOutput",
    "ScoringRequestOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "PoolingOutput",
    "PoolingRequestOutput",
]

_LAZY = {"LLM": "engine.llm", "AsyncEngine": "engine.async_engine"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
