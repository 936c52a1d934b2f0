"""The draft model of speculative decoding (``speculative_config={"model": DIR, ...}``, vLLM's
``draft_model``): a smaller model with the target's vocabulary that proposes the next tokens.

It owns its own paged KV cache with the target's block size and block count, indexed by the same
block tables and slot mapping, so whatever the block manager does to a block (prefix-cache hits,
partial-block copies, freeing) holds for both models' KV of it. Invariant: a request's draft KV is
valid for its first ``num_draft_computed`` positions, which after every step are at least the
target's ``num_computed_tokens``:

* ``follow`` runs the draft over every token the target computes in a step (prefill chunks, the
  drafts it verifies; every request, drafted for or not), from the request's ``num_draft_computed``
  on. Every block the engine computes therefore holds draft KV too, and a prefix-cache hit on it
  needs nothing more.
* KV that arrives from outside (the KV tier, a PD consumer's prefill) holds only the target's: the
  scheduler admits such a request with ``num_draft_computed`` before the loaded blocks, and its
  first step's ``follow`` recomputes the draft's KV for them (in one forward, beside the step).
* ``propose`` feeds the request's newest token and then its own drafts, one forward per draft
  position across the batch, greedy; the drafts' slots are allocated by the engine first. Drafts
  the target rejects leave draft KV past the accepted tokens, which the engine disowns
  (``num_draft_computed`` falls back to the target's computed tokens).

Draft KV that is wrong costs acceptance, never correctness: the target verifies every draft
(engine/spec_decode.py). One way it can be: blocks loaded from the tier are registered in the
prefix cache at admission, and if their loader is preempted before its first step, later hits on
them read draft KV nobody computed, until they are evicted. Requests admitted in the same step as
the loader read them after its recompute (each layer stores the step's KV before it attends).

The first step after a tier load recomputes all the loaded positions in one draft forward, beside
the step's token budget; the CUDA activation reserve (engine/kv_budget.py) counts only the target.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine import runner_parts as parts
from engine.attention.base import FP8_DTYPES
from engine.classifier import is_classifier
from engine.models.config import ModelConfig, read_hf_config
from engine.models.kv_scales import take_kv_scales
from engine.models.loader import resolve_model_dir
from engine.models.quant_config import check_quantization
from engine.models.registry import get_model_class
from engine.ops import select_ops
from engine.sequence import Request
from engine.spec_decode import SpeculativeConfig

if TYPE_CHECKING:
    from engine.scheduler_output import ScheduledRequest


class PagedDraft(ABC):
    """A proposer's own paged KV cache beside the target's: same block size and block count,
    indexed by the target's block tables (the draft model's, and the MTP layer's in engine/mtp.py).
    The model runner sizes, allocates, copies and drops it with the target's."""

    kv_config: ModelConfig  # the layers whose KV it holds
    block_size: int
    kv_dtype: torch.dtype
    device: torch.device
    model: Any  # what sleep mode moves between devices
    max_model_len: int  # sequences longer than this get no drafts
    kv_caches: list[tuple[torch.Tensor, ...]]

    @property
    def bytes_per_block(self) -> int:
        return parts.kv_block_bytes(self.kv_config, self.block_size, self.kv_dtype)

    def allocate(self, num_blocks: int) -> None:
        self.kv_caches = parts.allocate_kv(
            self.kv_config, num_blocks, self.block_size, self.kv_dtype, self.device
        )

    def read_update(self, model_dir: Path) -> Any:
        """What a weight update of the target (new checkpoint ``model_dir``) changes here, read and
        checked off the engine's threads (ValueError if it cannot), or None: a draft model's weights
        are its own checkpoint's, which the target's update leaves alone."""
        return None

    def install_update(self, update: Any) -> None:
        """Serve ``read_update``'s result (called between steps, with the target's new weights)."""
        raise TypeError(f"{type(self).__name__} reads no weight update to install")

    @abstractmethod
    def follow(self, scheduled: list[ScheduledRequest], hidden: torch.Tensor) -> None:
        """In the step's forward, after the target's (``hidden``: its output after the final norm):
        compute what the step's positions need of this proposer's KV."""

    @abstractmethod
    def propose(self, batch: list[tuple[Request, int]], vocab: int) -> None:
        """After sampling: ``k`` drafts for each ``(request, k)`` into its ``spec_token_ids``."""


class DraftModel(PagedDraft):
    def __init__(self, runner: Any, spec: SpeculativeConfig, attention: Any) -> None:
        """Load the draft of ``spec`` beside ``runner``'s target (same dtype, device and attention
        backend). ValueError, naming the draft, when it cannot draft for the target."""
        self.model_dir = resolve_model_dir(spec.model)
        name = f"speculative_config model {spec.model!r}"
        try:
            raw = read_hf_config(self.model_dir, None)
            get_model_class(str((raw.get("architectures") or ["(none named)"])[0]))
            cfg = ModelConfig.from_dict(raw)
        except (ValueError, OSError) as e:
            raise ValueError(f"{name}: {e}") from None
        if is_classifier(cfg.architecture):
            raise ValueError(f"{name} is a sequence classifier ({cfg.architecture}); a draft must generate")
        target = runner.model_config
        if cfg.vocab_size != target.vocab_size:
            raise ValueError(
                f"{name} has vocab_size {cfg.vocab_size}, the target {target.vocab_size}: a draft model "
                "must share the target's vocabulary"
            )
        try:
            check_quantization(spec.quantization, cfg.quant_method)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        limit, source = parts.position_limit(cfg)
        if spec.max_model_len is not None and spec.max_model_len > limit:
            raise ValueError(
                f"speculative_config max_model_len={spec.max_model_len} is more than the {limit} positions "
                f"of the draft model ({source})"
            )
        self.kv_config = cfg
        # Sequences longer than this get no drafts (vLLM's draft max_model_len).
        self.max_model_len = min(spec.max_model_len or limit, runner.max_model_len)
        self.block_size = runner.block_size
        self.device = runner.device
        self.kv_dtype = runner.kv_dtype
        weights = parts.read_weights(self.model_dir, cfg, runner.dtype, self.device, None, dummy=False)
        kv_scales = take_kv_scales(weights, cfg.num_layers, self.kv_dtype in FP8_DTYPES)
        self.model = get_model_class(cfg.architecture)(
            cfg,
            weights,
            ops=select_ops(runner.attention_backend),
            attention=attention,
            deterministic=runner.config.deterministic,
            max_positions=self.max_model_len,
            device=self.device,
            kv_scales=kv_scales,
        )
        self.kv_caches: list[tuple[torch.Tensor, ...]] = []
        # Most tokens of one forward: what the CUDA activation reserve (engine/kv_budget.py) allows.
        self._budget = runner.config.max_num_batched_tokens

    @torch.inference_mode()
    def follow(self, scheduled: list[ScheduledRequest], hidden: torch.Tensor) -> None:
        """Compute the draft's KV for every position the step's target forward computes that it
        does not hold yet (from each request's ``num_draft_computed``, below its ``max_model_len``).
        ``hidden``, the target's output, is not needed: the draft reads tokens alone. Usually one
        forward of the step's tokens; KV the target loaded from the KV tier (none of it the
        draft's) is recomputed in forwards of at most the step's token budget."""
        segments: list[parts.Segment] = []
        for s in scheduled:
            req = s.request
            # Positions past the draft's max_model_len are never drafted from: no KV needed.
            first, end = req.num_draft_computed, min(s.start + s.num_new_tokens, self.max_model_len)
            if first >= end:
                continue  # the token and drafts were fed when they were proposed
            n = req.num_tokens
            ids = req.token_ids[first:end] + req.spec_token_ids[max(0, first - n) : max(0, end - n)]
            segments.append((ids, first, req.block_table))
            req.num_draft_computed = end
        for chunk, _, _ in parts.split_batch(segments, self._budget):
            input_ids, positions, meta = parts.build_batch(chunk, self.block_size, self.device)
            self.model.forward(input_ids, positions, self.kv_caches, meta)

    @torch.inference_mode()
    def propose(self, batch: list[tuple[Request, int]], vocab: int) -> None:
        """Set each request's ``spec_token_ids`` to the draft's greedy continuation of its tokens,
        ``k`` long for ``(request, k)``. The slots of positions ``num_tokens - 1`` to
        ``num_tokens + k - 2`` (the newest token and every draft but the last) must be allocated.
        ``vocab``: the columns that are tokens (padded embedding rows are never drafted). Requests
        with ``k`` 0 are left as they are."""
        batch = [item for item in batch if item[1] > 0]
        if not batch:
            return
        # Longest first, so each round's requests are a prefix of the previous round's and its
        # input ids a slice of that round's drafts: the drafts stay on the device until the end.
        batch = sorted(batch, key=lambda item: -item[1])
        rounds: list[torch.Tensor] = []
        for j in range(batch[0][1]):
            segments: list[parts.Segment] = []
            for req, k in batch:
                if k <= j:
                    break
                if j == 0:  # the newest token, after any the draft lacks
                    first = req.num_draft_computed
                    segments.append((req.token_ids[first:], first, req.block_table))
                else:  # the token is the previous round's draft, set below
                    segments.append(([0], req.num_tokens - 1 + j, req.block_table))
            input_ids, positions, meta = parts.build_batch(segments, self.block_size, self.device)
            if j:
                input_ids = rounds[-1][: len(segments)]
            hidden = self.model.forward(input_ids, positions, self.kv_caches, meta)
            if j == 0:
                hidden = hidden.index_select(0, meta.query_start_loc[1:].long() - 1)
            rounds.append(self.model.compute_logits(hidden)[:, :vocab].argmax(dim=-1))
        drafts = [r.tolist() for r in rounds]
        for row, (req, k) in enumerate(batch):
            req.spec_token_ids = [drafts[j][row] for j in range(k)]
            req.num_draft_computed = req.num_tokens - 1 + k
