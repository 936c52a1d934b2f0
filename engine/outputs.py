"""What the engine hands back: typed, torch-free results (the server and router import these)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

_Pooled = TypeVar("_Pooled")


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1-based rank in the distribution
    decoded_token: str | None = None


# One entry per position: token id -> Logprob (the chosen token plus the top-N).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    # With finish_reason "abort": why the engine ended it, for the client (its structured-outputs
    # grammar cost the engine thread too much a token: engine/grammar_matcher.py); None otherwise.
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the device prefix cache or the KV tier
    metrics: dict[str, float] = field(default_factory=dict)  # time.monotonic() seconds: arrival_time,
    # first_scheduled_time, first_token_time, finished_time
    kv_transfer: dict | None = (
        None  # on the final output of a kv_transfer request: block_hashes, num_cached_tokens
    )
    # On the final output of a pooling request: the prompt's pooled hidden state (after the final
    # norm; fp32, not normalised), or on a classifier model its score head's logits over it.
    embedding: list[float] | None = None
    lora_request: Any = None  # the offline LLM's: the LoRARequest the prompt ran with (vLLM's)


def merge_deltas(out: RequestOutput, nxt: RequestOutput) -> RequestOutput:
    """``nxt`` carrying ``out``'s delta in front of its own (two DELTA outputs of one request as one)."""
    a, b = out.outputs[0], nxt.outputs[0]
    b.token_ids = a.token_ids + b.token_ids
    b.text = a.text + b.text
    if a.logprobs is not None or b.logprobs is not None:
        b.logprobs = (a.logprobs or []) + (b.logprobs or [])
    return nxt


async def gather_interval(out: RequestOutput, queue: asyncio.Queue, interval: int) -> RequestOutput:
    """``out`` with the deltas after it folded in until it holds ``interval`` tokens or the last
    output (vLLM's ``stream_interval``: fewer, larger chunks). An error met on the way is put back:
    what came before it goes out first."""
    while not out.finished and len(out.outputs[0].token_ids) < interval:
        nxt = await queue.get()
        if isinstance(nxt, BaseException):
            queue.put_nowait(nxt)
            break
        out = merge_deltas(out, nxt)
    return out


def merge_pending(out: RequestOutput, queue: asyncio.Queue) -> RequestOutput:
    """Fold deltas that queued up while the consumer was busy into one (fewer, larger chunks)."""
    while not out.finished and not queue.empty():
        nxt = queue.get_nowait()
        if isinstance(nxt, BaseException):
            queue.put_nowait(nxt)
            break
        out = merge_deltas(out, nxt)
    return out


# The offline LLM's pooling results (engine/llm_pooling.py), in vLLM's shapes: each request output
# carries ``outputs`` (what was pooled), ``prompt_token_ids`` and ``num_cached_tokens`` (prompt
# tokens served from the prefix cache or the KV tier).


@dataclass
class PoolingOutput:
    """``LLM.encode``'s result for one prompt (vLLM's ``PoolingOutput``): ``data``, a float32 torch
    tensor (typed Any: this module is torch-free)."""

    data: Any


@dataclass
class EmbeddingOutput:
    """One prompt's embedding (vLLM's ``EmbeddingOutput``): L2-normalised unless the
    ``PoolingParams`` said ``normalize=False``."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    """One input's classification (vLLM's ``ClassificationOutput``): ``probs`` is the activation the
    model's config names over ``logits`` (engine/classifier.py; the logits themselves with
    ``PoolingParams(use_activation=False)``), ``logits`` the score head's own."""

    probs: list[float]
    logits: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class PoolingRequestOutput(Generic[_Pooled]):
    """``LLM.encode``'s result for one prompt (vLLM's shape: ``.outputs.data``); the results of
    ``embed``, ``classify`` and ``score`` below are this with their own ``outputs``, as vLLM's are."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: _Pooled
    num_cached_tokens: int = 0
    finished: bool = True


@dataclass
class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    """``LLM.embed``'s result for one prompt (vLLM's shape: ``.outputs.embedding``)."""


@dataclass
class ClassificationRequestOutput(PoolingRequestOutput[ClassificationOutput]):
    """``LLM.classify``'s result for one prompt (vLLM's shape: ``.outputs.probs``)."""


@dataclass
class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    """``LLM.score``'s result for one pair (vLLM's shape: ``.outputs.score``); a cross-encoder's
    ``prompt_token_ids`` are the pair's, as the model read them (a bi-encoder's: both texts', one
    after the other; ``num_cached_tokens`` then counts both)."""
