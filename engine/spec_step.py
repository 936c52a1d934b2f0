"""Speculative decoding's part of a step (``LLMEngine`` inherits ``SpecDecodeStep``): walk the drafts
a step verified, and propose the next ones for the requests that sampled.

The scheduler gave a decoding request ``1 + drafts`` tokens and the runner a logits row per
position; ``_verify`` keeps drafts while each position's draw equals its draft, so a request's
tokens are those it would have drawn one at a time, and counts the kept drafts' KV as computed.
``_propose`` (chosen once in ``LLMEngine.__init__``: ``_propose_ngram``, or ``_propose_draft`` for a
draft model or MTP layer) drafts for the step's sampled requests in one call. The proposers and
the draft models live in engine/spec_decode.py, engine/draft_model.py and engine/mtp.py; this
module never samples, schedules or frees blocks: it reads what the sampler drew and, for a draft
model, allocates only the slots the draft writes.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

from engine.outputs import RequestOutput, merge_deltas

if TYPE_CHECKING:
    from engine.sampler import SamplerOutput
    from engine.scheduler_output import ScheduledRequest
    from engine.sequence import Request


class SpecDecodeStep:
    """``LLMEngine``'s draft verification and proposal. Uses its ``config``, ``model_runner`` (its
    ``draft``), ``block_manager``, ``post``, ``proposer``, ``max_model_len``, ``sampling_vocab_size``
    and the ``spec_*`` counters its ``stats()`` reports."""

    def _verify(
        self, s: ScheduledRequest, sampled: SamplerOutput, i: int, out: RequestOutput
    ) -> RequestOutput:
        """Walk a request's drafts after its first token (``out``, drawn at row ``i``): while the
        token drawn at a position equals the draft there, that draft's KV holds and the next
        position's draw is the next token. Returns the step's whole delta."""
        req, drafts = s.request, s.request.spec_token_ids
        accepted = 0
        while (
            accepted < s.num_spec
            and req.finish_reason is None
            and sampled.token_ids[i + accepted] == drafts[accepted]
        ):
            accepted += 1
            out = merge_deltas(out, self.post.append_token(req, sampled, i + accepted))
        req.num_computed_tokens += accepted
        req.spec_token_ids = []
        self.spec_drafts += 1
        self.spec_draft_tokens += s.num_spec
        self.spec_accepted_tokens += accepted
        for pos in range(accepted):
            self.spec_accepted_per_position[pos] += 1
        return out

    def _room(self, req: Request) -> int:
        """Most drafts a request's next step may verify: its tokens then, drafts and the token
        drawn after them, stay within ``max_tokens`` and ``max_model_len``. None under structured
        outputs (whose grammar would have to walk the drafts)."""
        if req.grammar is not None:
            return 0
        return (
            min((req.params.max_tokens or 0) - req.num_output_tokens, self.max_model_len - req.num_tokens) - 1
        )

    def _propose_ngram(self, requests: list[Request]) -> None:
        for req in requests:
            room = self._room(req)
            if room <= 0:
                continue
            tokens = req.lookup_tokens
            if tokens is None:
                tokens = req.lookup_tokens = array("i", req.token_ids)
            else:
                tokens.extend(req.token_ids[len(tokens) :])
            req.spec_token_ids = self.proposer.propose(tokens, room)  # type: ignore[union-attr]

    def _propose_draft(self, requests: list[Request]) -> None:
        """The draft model's drafts for the requests, in one batch. It feeds each request's newest
        token and every draft but the last: their slots are allocated now (vLLM's lookahead
        slots), and where blocks are short a request gets only the drafts its blocks hold. Requests
        without room go too, with no drafts: the MTP layer (engine/mtp.py) completes their entries."""
        draft, bm = self.model_runner.draft, self.block_manager
        k_max, bs = self.config.speculative_config.num_speculative_tokens, self.config.block_size
        batch: list[tuple[Request, int]] = []
        for req in requests:
            # Draft KV past the accepted tokens holds rejected drafts.
            req.num_draft_computed = min(req.num_draft_computed, req.num_computed_tokens)
            newest = req.num_tokens - 1  # the position the draft feeds first
            k = min(self._room(req), k_max, draft.max_model_len - newest)  # type: ignore[union-attr]
            if k > 0 and not bm.may_append(req.block_table, newest + k):
                k = len(req.block_table) * bs - newest
            batch.append((req, max(k, 0)))
        draft.propose(batch, self.sampling_vocab_size)  # type: ignore[union-attr]
