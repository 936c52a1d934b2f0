"""Speculative decoding with the target's own multi-token-prediction layer
(``speculative_config={"method": "mtp"}``, vLLM's ``deepseek_mtp``): DeepSeek-V3 checkpoints hold
one (``num_nextn_predict_layers: 1``) after their decoder layers (engine/models/deepseek_mtp.py).

The layer's entry at position i reads the target's hidden state at i and the token at i + 1, and
predicts the token at i + 2. It attends over the entries before it through its own paged latent
cache (``PagedDraft``: the target's block ids and slots, one layer's share of every block).
Invariant: a request's entries are valid for its first ``num_draft_computed`` positions, each
computed from the target's hidden state there and the request's real next token:

* ``follow`` (in the step's forward, with the target's hidden states) computes the entries whose
  next token was known before the step: prompt chunks.
* ``propose`` (after sampling) computes the rest of the step's entries, up to the newest token's
  predecessor, from the step's hidden states and the tokens the step accepted and drew; the last
  one's logits give the first draft. Each further draft feeds the layer its own output and its
  previous draft at the next position (vLLM does the same with one layer). Those chained entries
  are not counted: the next step's entries overwrite them. Every request that sampled and goes on
  is completed so, drafted for or not (structured outputs get no drafts).
* KV that the target did not compute in this engine has no hidden states to read: blocks loaded
  from the KV tier, and the last position of a prefix-cache hit (its entry was computed with
  whichever token followed it there). The scheduler admits such a request with
  ``num_draft_computed`` before them, and its first ``follow`` runs the target again over those
  positions for their hidden states (beside the step, in forwards of at most the step's token
  budget; it rewrites the target's KV there with what it holds, bit for bit in deterministic
  mode). A PD consumer thus pays a prefill of the loaded prompt once more.

A finished request's last entry is never computed; a later prefix hit on its last full block
reads it stale. Entries that are wrong cost acceptance, never correctness: the target verifies
every draft (engine/spec_decode.py).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine import runner_parts as parts
from engine.draft_model import PagedDraft
from engine.models.config import read_hf_config
from engine.models.deepseek import DeepseekForCausalLM
from engine.models.deepseek_mtp import DeepseekMTP
from engine.models.loader import load_weights
from engine.models.registry import get_model_class
from engine.ops import select_ops
from engine.sequence import Request
from engine.weight_update import tensor_pairs

if TYPE_CHECKING:
    from engine.scheduler_output import ScheduledRequest


class MTPProposer(PagedDraft):
    def __init__(self, runner: Any, attention: Any) -> None:
        """Load ``runner``'s checkpoint's MTP layer beside its target. ValueError, saying why, when
        the model has none ferry can run."""
        cfg = runner.model_config
        name = f"speculative_config method 'mtp' ({cfg.architecture})"
        if get_model_class(cfg.architecture) is not DeepseekForCausalLM:
            raise ValueError(f"{name}: ferry runs DeepSeek-V2/V3-style MTP layers only")
        count = int(
            read_hf_config(runner.model_dir, runner.config.hf_overrides).get("num_nextn_predict_layers") or 0
        )
        if count == 0:
            raise ValueError(
                f"{name}: the model has no multi-token-prediction layer (num_nextn_predict_layers is 0 or "
                "absent in config.json)"
            )
        if count > 1:
            raise ValueError(
                f"{name}: num_nextn_predict_layers={count}; ferry drafts with a single MTP layer"
            )
        if runner.config.load_format == "dummy":
            raise ValueError(f"{name} reads the MTP layer from the checkpoint: not with load_format 'dummy'")
        self._runner = runner  # its model and KV cache as they are at each step (weight updates, sleep)
        self._attention = attention
        self._name = name
        weights = self._load(runner.model_dir, runner.device)
        if not weights:
            raise ValueError(
                f"{name}: the model has no multi-token-prediction layer (config.json says "
                f"num_nextn_predict_layers={count}, the checkpoint holds no "
                f"model.layers.{cfg.num_layers}.* tensors)"
            )
        self.model = self._build(weights, runner.device)
        self.kv_config = replace(cfg, num_layers=1)
        self.block_size = runner.block_size
        self.device = runner.device
        self.kv_dtype = runner.kv_dtype
        self.max_model_len = runner.max_model_len
        # Most tokens of one forward: what the CUDA activation reserve (engine/kv_budget.py) allows.
        self._budget = runner.config.max_num_batched_tokens
        self.kv_caches: list[tuple[torch.Tensor, ...]] = []
        # The step's target hidden states, and each request's row of position 0 in them.
        self._hidden: torch.Tensor | None = None
        self._rows: dict[Request, int] = {}

    def _load(self, model_dir: Path, device: torch.device) -> dict[str, torch.Tensor]:
        """The checkpoint's MTP-layer tensors (``model.layers.{num_layers}.*``) as the target loads its own."""
        runner, cfg = self._runner, self._runner.model_config
        return load_weights(
            model_dir, runner.dtype, device, DeepseekMTP.FP32_WEIGHTS,
            fp8_block=cfg.fp8_block, quant=cfg.weight_quant, layer=cfg.num_layers,
        )  # fmt: skip

    def _build(self, weights: dict[str, torch.Tensor], device: torch.device) -> DeepseekMTP:
        runner = self._runner
        try:
            return DeepseekMTP(
                runner.model_config,
                weights,
                ops=select_ops(runner.attention_backend),
                attention=self._attention,
                deterministic=runner.config.deterministic,
                max_positions=runner.max_model_len,
                device=device,
            )
        except KeyError as e:
            raise ValueError(f"{self._name}: the checkpoint lacks {e.args[0]}") from None

    def read_update(self, model_dir: Path) -> DeepseekMTP:
        """A weight update's MTP layer, built in host memory and checked against the serving one's
        tensors (ValueError, before anything changed, when the checkpoint has none or others). Any
        thread."""
        host = torch.device("cpu")
        weights = self._load(model_dir, host)
        if not weights:
            raise ValueError(
                f"{model_dir}: the new checkpoint has no multi-token-prediction layer "
                f"(model.layers.{self._runner.model_config.num_layers}.*), which the served one drafts with"
            )
        new = self._build(weights, host)
        if tensor_pairs(self.model, new) is None:
            raise ValueError(
                f"{model_dir}: its multi-token-prediction layer has other shapes than the served one's"
            )
        return new

    def install_update(self, new: DeepseekMTP) -> None:
        """Serve ``read_update``'s layer: its tensors copied over the serving layer's, wherever those
        are now (the device, or host memory while asleep), so the device never holds two."""
        with torch.inference_mode():
            for dst, src in tensor_pairs(self.model, new) or ():
                dst.copy_(src)

    @torch.inference_mode()
    def follow(self, scheduled: list[ScheduledRequest], hidden: torch.Tensor) -> None:
        """Keep the step's target hidden states (``hidden``, after the final norm) for ``propose``,
        and compute each request's entries whose next token is already known, from its
        ``num_draft_computed`` on (running the target again for positions before the step)."""
        self._hidden, self._rows = hidden, {}
        segments: list[parts.Segment] = []
        gaps: list[parts.Segment] = []  # positions whose hidden states the step did not compute
        pieces: list[tuple[int, int, int]] = []  # per segment: (gap rows, first step row, end step row)
        row = 0
        for s in scheduled:
            req = s.request
            self._rows[req] = row - s.start
            first, end = req.num_draft_computed, min(s.start + s.num_new_tokens, req.num_tokens - 1)
            if first < end:
                gap = max(0, s.start - first)
                if gap:
                    gaps.append((req.token_ids[first : s.start], first, req.block_table))
                segments.append((req.token_ids[first + 1 : end + 1], first, req.block_table))
                pieces.append((gap, row + first + gap - s.start, row + end - s.start))
                req.num_draft_computed = end
            row += s.num_new_tokens
        if not segments:
            return
        recomputed = self._target_hidden(gaps) if gaps else None
        rows: list[torch.Tensor] = []
        taken = 0
        for gap, lo, hi in pieces:
            if gap:
                rows.append(recomputed[taken : taken + gap])  # type: ignore[index]
                taken += gap
            rows.append(hidden[lo:hi])
        previous = torch.cat(rows)
        embed, cache = self._embed(), self.kv_caches[0][0]
        for chunk, lo, hi in parts.split_batch(segments, self._budget):  # one forward but after a gap
            input_ids, positions, meta = parts.build_batch(chunk, self.block_size, self.device)
            self.model.forward_mtp(input_ids, positions, previous[lo:hi], cache, meta, embed)

    def _target_hidden(self, segments: list[parts.Segment]) -> torch.Tensor:
        """The target's hidden states over ``segments`` (whose KV it holds)."""
        runner, out = self._runner, []
        for chunk, _, _ in parts.split_batch(segments, self._budget):
            input_ids, positions, meta = parts.build_batch(chunk, self.block_size, self.device)
            out.append(runner.model.forward(input_ids, positions, runner.kv_caches, meta))
        return torch.cat(out)

    def _embed(self) -> torch.Tensor:
        return self.model.embed if self.model.embed is not None else self._runner.model.embed

    @torch.inference_mode()
    def propose(self, batch: list[tuple[Request, int]], vocab: int) -> None:
        """Complete each request's entries up to its newest token's predecessor and set its
        ``spec_token_ids`` to ``k`` greedy drafts for ``(request, k)`` (none for 0). Every request
        was sampled in the step ``follow`` last saw. The slots of positions up to
        ``num_tokens + k - 3`` (the chained entries) must be allocated. ``vocab``: the columns that
        are tokens."""
        runner, hidden, cache = self._runner, self._hidden, self.kv_caches[0][0]
        head = self.model.lm_head if self.model.lm_head is not None else runner.model.lm_head
        embed = self._embed()
        # Longest first, so each chained round's requests are a prefix of the previous round's.
        batch = sorted(batch, key=lambda item: -item[1])
        segments: list[parts.Segment] = []
        rows: list[int] = []
        for req, _ in batch:
            first, newest = req.num_draft_computed, req.num_tokens - 1
            segments.append((req.token_ids[first + 1 :], first, req.block_table))
            rows.extend(range(self._rows[req] + first, self._rows[req] + newest))
        input_ids, positions, meta = parts.build_batch(segments, self.block_size, self.device)
        previous = hidden.index_select(0, torch.tensor(rows, dtype=torch.long, device=self.device))  # type: ignore[union-attr]
        out = self.model.forward_mtp(input_ids, positions, previous, cache, meta, embed)
        drafting = sum(1 for _, k in batch if k > 0)
        rounds: list[torch.Tensor] = []
        if drafting:
            out = out.index_select(0, meta.query_start_loc[1 : drafting + 1].long() - 1)
            for j in range(batch[0][1]):
                rounds.append(self.model.mtp_logits(out, head)[:, :vocab].argmax(dim=-1))
                chained = sum(1 for _, k in batch if k > j + 1)
                if not chained:
                    break
                # The next entry: the previous draft at the position after the last one fed.
                segments = [([0], req.num_tokens - 1 + j, req.block_table) for req, _ in batch[:chained]]
                _, positions, meta = parts.build_batch(segments, self.block_size, self.device)
                out = self.model.forward_mtp(
                    rounds[-1][:chained], positions, out[:chained], cache, meta, embed
                )
        drafts = [r.tolist() for r in rounds]
        for row, (req, k) in enumerate(batch):
            req.spec_token_ids = [drafts[j][row] for j in range(k)]
            req.num_draft_computed = req.num_tokens - 1
        self._hidden, self._rows = None, {}
