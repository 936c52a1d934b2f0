"""After sampling: append tokens, apply stop conditions, detokenize, and build RequestOutputs.

Stop order per sampled token: a structured-outputs grammar that is complete (its stop token
accepted, whatever ignore_eos says), one that allows no token at all (a dead end: "abort", with
``error``; the token drawn from the empty mask is not written), one past its cost budget ("abort",
with ``error``), EOS (unless ignore_eos), a ``stop_token_ids`` id, an output ending in one N-gram
repeated (``repetition_detection``, engine/repetition.py: "stop", stop reason "repetition_detected",
unless a length cap falls on the same token), a stop string (found by the detokenizer),
``max_tokens`` (-> "length"), ``max_model_len`` (-> "length"). EOS and stop ids are masked by the
sampler until ``min_tokens`` is reached, and repetition is looked for only from then on; stop strings
count only once more than ``min_tokens`` tokens are out (the detokenizer checks).
"""

from __future__ import annotations

import logging

from engine.model_runner import PromptLogits
from engine.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from engine.repetition import STOP_REASON as REPETITION_STOP_REASON
from engine.sampler import SamplerOutput, prompt_logprobs
from engine.sequence import Request
from engine.tokenizer import Tokenizer
from kvcache.keys import to_hex

log = logging.getLogger(__name__)


class Postprocessor:
    def __init__(
        self,
        tokenizer: Tokenizer,
        max_model_len: int,
        vocab_size: int | None = None,
        logprobs_mode: str = "raw_logprobs",
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size  # logit columns past it (embedding padding) are not tokens
        self.logprobs_mode = logprobs_mode  # the engine's; a request's own takes precedence

    def _entry(
        self,
        token: int,
        logprob: float,
        rank: int | None,
        top: list[tuple[int, float]] | None,
        top_ranks: list[int] | None = None,
    ) -> PositionLogprobs:
        """The sampled token first, then ``top`` (the natural top-N, ranked 1..N, or the request's
        ``logprob_token_ids`` in its order, with ``top_ranks``)."""
        text = self.tokenizer.token_text
        entry: PositionLogprobs = {token: Logprob(logprob, rank, text(token))}
        for j, (tid, lp) in enumerate(top or []):
            if tid not in entry:
                entry[tid] = Logprob(lp, top_ranks[j] if top_ranks is not None else j + 1, text(tid))
        return entry

    def append_token(self, req: Request, sampled: SamplerOutput, i: int) -> RequestOutput:
        token = sampled.token_ids[i]
        req.append_token(token)
        entries: list[PositionLogprobs] | None = None
        if req.logprobs is not None:
            lp = sampled.logprobs[i]
            named = sampled.top_ranks[i] if sampled.top_ranks is not None else None
            entry = self._entry(token, lp, sampled.ranks[i], sampled.top_logprobs[i], named)
            req.logprobs.append(entry)
            req.cumulative_logprob = (req.cumulative_logprob or 0.0) + lp
            entries = [entry]
        params = req.params
        n_out = req.num_output_tokens
        reason: str | None = None
        stop_reason: int | str | None = None
        grammar = req.grammar
        refused = grammar is not None and not grammar.accept(token)
        if grammar is not None and refused:
            # End the request rather than write output its structure forbids. Its grammar allowed
            # no token at all (a dead end of the client's constraint): ended with the reason for
            # the client. Otherwise a token drawn under the mask was refused (a NaN row): a bug.
            detok = req.detokenizer
            if grammar.dead_end(n_out - 1, detok.text if detok is not None else ""):
                log.warning("request %s: ended after %d tokens: %s", req.request_id, n_out - 1, grammar.error)
            else:
                log.error(
                    "request %s: token %d, drawn under its structured outputs mask, was refused; aborted",
                    req.request_id,
                    token,
                )
            reason = "abort"
        elif req.grammar is not None and req.grammar.terminated:
            reason = "stop"
        elif req.grammar is not None and req.grammar.error is not None:
            # Its mask costs the engine thread more than the budget a token, and every request in
            # the batch waits for it: ended, with the reason for the client.
            log.warning("request %s: ended after %d tokens: %s", req.request_id, n_out, req.grammar.error)
            reason = "abort"
        elif n_out >= params.min_tokens:
            if token in req.eos_token_ids and not params.ignore_eos:
                reason = "stop"
            elif token in params.stop_token_ids:
                reason, stop_reason = "stop", token
            elif (
                params.repetition_detection is not None
                and n_out < (params.max_tokens or 0)
                and req.num_tokens < self.max_model_len
                and params.repetition_detection.repeats(req.output_token_ids)
            ):
                # As vLLM's: a length cap reached on the same token wins.
                reason, stop_reason = "stop", REPETITION_STOP_REASON
        detok = req.detokenizer
        # A token its grammar refused is not written: its text is not the client's. The token that
        # completes a repetition is output like any other (as vLLM's, and server.token_deltas reads
        # it so); a token that ends the request by what it is (EOS, a stop id, a grammar's end) has no text.
        by_token = reason is not None and stop_reason != REPETITION_STOP_REASON
        text = detok.append([token], stop_terminated=by_token) if detok is not None and not refused else ""
        if reason is None and detok is not None and detok.stop_hit is not None:
            reason, stop_reason = "stop", detok.stop_hit
        if reason is None and (n_out >= (params.max_tokens or 0) or req.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            req.finish_reason, req.stop_reason = reason, stop_reason
            if detok is not None:
                text += detok.flush()
                # A stop string its text completes wins over a length cap or a repetition met on the
                # same token (vLLM's output processor looks for stop strings after the engine stopped).
                if detok.stop_hit is not None and not by_token:
                    req.finish_reason, req.stop_reason = "stop", detok.stop_hit
        return self.delta(req, [token], text, entries)

    def add_prompt_logprobs(self, pl: PromptLogits, rows: int) -> None:
        """The step's prompt logprobs of ``pl``'s request, from its logits ``rows`` at a time."""
        req = pl.scheduled.request
        first = pl.first
        as_logits = (req.params.logprobs_mode or self.logprobs_mode).endswith("_logits")
        for logits in pl.chunks(rows):
            nxt = req.prompt_token_ids[first : first + logits.shape[0]]
            first += logits.shape[0]
            for lp, rank, top in prompt_logprobs(
                logits, nxt, req.params.prompt_logprobs or 0, vocab_size=self.vocab_size, as_logits=as_logits
            ):
                token = req.prompt_token_ids[len(req.prompt_logprobs)]
                req.prompt_logprobs.append(self._entry(token, lp, rank, top))

    def delta(
        self, req: Request, token_ids: list[int], text: str, logprobs: list[PositionLogprobs] | None
    ) -> RequestOutput:
        finished = req.finish_reason is not None
        comp = CompletionOutput(
            index=0,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=req.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            error=req.grammar.error if req.finish_reason == "abort" and req.grammar is not None else None,
        )
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[comp],
            finished=finished,
            num_cached_tokens=req.num_cached_tokens,
            metrics=req.metrics.as_dict(),
        )

    def finalize(self, req: Request, out: RequestOutput) -> RequestOutput:
        """Attach what only the last output carries: prompt logprobs, KV-transfer results, metrics."""
        out.prompt_logprobs = req.prompt_logprobs
        out.metrics = req.metrics.as_dict()
        if req.kv_transfer is not None:
            bs = req.block_size
            info = {
                "block_hashes": to_hex(req.block_hashes[: req.num_prompt_tokens // bs]),
                "num_cached_tokens": req.num_cached_tokens,
            }
            info.update(req.kv_transfer_result or {})
            out.kv_transfer = info
        return out

    def final(self, req: Request) -> RequestOutput:
        """The cumulative output of a finished request (the offline ``LLM`` API)."""
        detok = req.detokenizer
        out = self.delta(
            req, list(req.output_token_ids), detok.text if detok is not None else "", req.logprobs
        )
        return self.finalize(req, out)
