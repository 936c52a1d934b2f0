"""One engine request: it owns its tokens, its progress and its block table.

Scheduling reads only ``num_computed_tokens`` against ``num_tokens``: a fresh prompt, a chunked
prefill, a prefix-cache hit, a recompute after preemption and a decode step are all "compute the
tokens from num_computed_tokens on", so there are no prefill or decode phases.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvcache.keys import ImageSpan, extend_hashes, image_extra

if TYPE_CHECKING:
    from concurrent.futures import Future

    from engine.detokenizer import IncrementalDetokenizer
    from engine.outputs import PositionLogprobs
    from engine.sampling_params import SamplingParams
    from engine.structured_output import RequestGrammar
    from engine.thinking_budget import ThinkingTracker


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, KV dropped, recomputed on readmission
    LOADING = "loading"  # parked while its prefix blocks load from the KV tier
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    """Timestamps from ``time.monotonic()`` (seconds)."""

    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    def as_dict(self) -> dict[str, float]:
        return {k: v for k, v in vars(self).items() if v is not None}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        seed: int,
        eos_token_ids: tuple[int, ...],
        block_size: int,
        prompt: str | None = None,
        resume_token_ids: list[int] | None = None,
        kv_transfer: dict[str, Any] | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.seed = seed
        self.eos_token_ids = eos_token_ids
        self.block_size = block_size
        self.prompt_token_ids = list(prompt_token_ids)
        resumed = list(resume_token_ids or [])
        self.token_ids: list[int] = self.prompt_token_ids + resumed
        self.output_token_ids: list[int] = resumed  # resumed tokens count as output (max_tokens)
        self.num_resumed_tokens = len(resumed)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache or the tier (first admission)
        self.block_table: list[int] = []
        self.num_released_blocks = 0  # leading table entries given back (behind the attention window)
        self.block_hashes: list[bytes] = []
        self.num_registered_blocks = 0  # leading blocks already registered in the prefix cache
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.kv_transfer = kv_transfer  # set by the caller; read by the KV connector
        self.kv_transfer_result: dict[str, Any] | None = None  # what the connector reports back
        # ... or will report: the final output waits for it (a producer's blocks being written)
        self.kv_transfer_future: Future[dict[str, Any]] | None = None
        self.metrics = RequestMetrics()
        self.detokenizer: IncrementalDetokenizer | None = None
        self.grammar: RequestGrammar | None = None  # structured outputs: where the output is in its grammar
        self.thinking: ThinkingTracker | None = None  # thinking_token_budget: where the thought is
        self.logprobs: list[PositionLogprobs] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.prompt_logprobs: list[PositionLogprobs | None] | None = (
            None if params.prompt_logprobs is None else [None]
        )
        self.num_preemptions = 0
        self.admitted_once = False
        # vLLM's request priority (lower runs first under --scheduling-policy priority) and the
        # order the scheduler received it in (engine/scheduler.py sets it).
        self.priority = 0
        self.arrival_seq = 0
        # An embedding request: the prompt's last hidden state is its result, nothing is sampled.
        self.pooling = False
        self.embedding: list[float] | None = None
        # mean pooling: the fp32 sum of the prompt rows computed so far; cls: the first row
        self.pooled_rows: Any = None
        # The LoRA adapter it runs with (engine/lora.py LoRAAdapter), and the block-hash salt that
        # keeps its KV blocks apart from the base model's and other adapters'.
        self.lora: Any = None
        self.block_extra = b""
        # Speculative decoding (engine/spec_decode.py): the draft tokens the next step verifies, and
        # the tokens as int32 for the n-gram lookup (kept up to date by the proposer).
        self.spec_token_ids: list[int] = []
        self.lookup_tokens: Any = None
        # With a draft model (engine/draft_model.py): leading positions whose draft KV is valid.
        self.num_draft_computed = 0
        # Images (engine/multimodal.py ImageInput, in prompt order), their placeholder runs for the
        # block hashes, and the encoded features of those whose run is being computed (index ->
        # tensor), kept from the first chunk that reaches a run until the run is computed.
        self.images: list[Any] = []
        self.image_spans: tuple[ImageSpan, ...] = ()
        self.image_features: dict[int, Any] = {}
        # A prompt given as embeddings (engine/prompt_embeds.py): its token ids are placeholders,
        # which the sampler's penalties do not count as prompt tokens (``penalty_prompt_ids``).
        self.prompt_embeds = False
        self.penalty_prompt_ids: list[int] = self.prompt_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int | None:
        return self.params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def full_block_hashes(self) -> list[bytes]:
        """Chained hashes of every full block of the known tokens (extended incrementally)."""
        return extend_hashes(
            self.block_hashes, self.token_ids, self.block_size, self.block_extra, self.image_spans
        )

    def partial_extra(self, block_index: int) -> bytes:
        """What keys a cached partial block of block ``block_index`` besides its parent hash: the
        request's salt and the images overlapping that block."""
        if not self.image_spans:
            return self.block_extra
        start = block_index * self.block_size
        return self.block_extra + image_extra(self.image_spans, start, start + self.block_size)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={self.block_table}, {self.status.value})"
        )
