"""Beam search over the engine's one-token steps (vLLM's ``use_beam_search`` / ``LLM.beam_search``).

Beam search runs outside the scheduler, as vLLM's does: each step submits every live beam as its
own one-token request (greedy, with the top-K raw logprobs), and the prefix cache serves what the
beams share, so a step recomputes at most the last partial block of each beam. ``BeamSearch`` is
the search state of one prompt and knows nothing of how steps run; the offline ``LLM`` drives it
with the engine's own loop, the server with ``AsyncEngine.generate`` (``server/generation.py``).

The algorithm and its score are vLLM's, so a migrating user gets the same beams:

* a step expands each live beam by its K = max(2 * beam_width, beam_width + F) most likely tokens
  (F: the tokens that end a beam), by log-probability of the model's raw distribution;
* an ending token (EOS unless ``ignore_eos``, a ``stop_token_ids`` entry) makes a completed beam;
  every other candidate, best cumulative log-probability first, makes a live beam until
  ``beam_width`` of them are taken (a candidate whose text reaches a ``stop`` string completes,
  and does not take a place);
* after ``max_tokens`` steps, or when no beam is live, the completed and live beams are ranked by
  ``cum_logprob / len ** length_penalty``, ``len`` counting the prompt and the output without its
  ending token, and the best ``beam_width`` are the answer. (The search also ends once no live
  beam could still make the answer, which changes nothing but the time it takes: ``_settled``.)

It is deterministic: temperature, top-p/top-k/min-p, penalties and seeds do not apply.

Must stay torch-free (the server imports it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from engine.outputs import CompletionOutput, Logprob, PositionLogprobs
from engine.sampling_params import SamplingParams


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``, plus the stopping fields the OpenAI endpoints carry.

    ``temperature`` is accepted for vLLM's callers and does not change the search (scores are
    the model's raw log-probabilities, as in vLLM v1). ``logprobs``: the top-N alternatives
    reported for each output token (None: none); ``prompt_logprobs`` likewise for the prompt.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True

    def validate(self) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be at least 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        for name, n in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            if n is not None and n < 0:
                raise ValueError(f"{name} must be non-negative, got {n}")


@dataclass
class BeamSearchSequence:
    """One beam: ``tokens`` holds the prompt and the output (vLLM's layout); ``logprobs`` one
    entry per output token (empty unless ``BeamSearchParams.logprobs`` is set)."""

    tokens: list[int]
    cum_logprob: float = 0.0
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The answer for one prompt: the best ``beam_width`` sequences, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(length: int, cum_logprob: float, length_penalty: float) -> float:
    """vLLM's ranking score: ``length`` counts the prompt and the output without its ending token."""
    return cum_logprob / (max(length, 1) ** length_penalty)


def candidates_per_beam(params: BeamSearchParams, num_ending_tokens: int) -> int:
    """K: top tokens a step looks at per beam; enough that ``beam_width`` live candidates remain
    after the ending ones leave (and the top-N the client asked for)."""
    k = max(2 * params.beam_width, params.beam_width + num_ending_tokens)
    return max(k, params.logprobs or 0)


class BeamSearch:
    """The search state of one prompt. Per step: ``step_params()`` for each of ``live`` (each beam's
    ``tokens`` is that step's prompt), then ``advance()`` with each one's position logprobs."""

    def __init__(
        self,
        prompt_token_ids: Sequence[int],
        params: BeamSearchParams,
        eos_token_ids: Sequence[int],
        tokenizer: _Decoder,
    ) -> None:
        params.validate()
        self.params = params
        self.prompt_len = len(prompt_token_ids)
        self._tokenizer = tokenizer
        self._eos = frozenset(() if params.ignore_eos else eos_token_ids)
        self._ending = self._eos | frozenset(params.stop_token_ids)
        self.k = candidates_per_beam(params, len(self._ending))
        self.live = [BeamSearchSequence(tokens=list(prompt_token_ids))]
        self.completed: list[BeamSearchSequence] = []
        self.steps = 0

    @property
    def done(self) -> bool:
        return not self.live or self.steps >= self.params.max_tokens or self._settled()

    def _settled(self) -> bool:
        """No live beam can reach the answer any more: the best score a continuation of it could
        get (its log-probability only falls; its length at most reaches ``max_tokens``) is below
        the worst of the ``beam_width`` best completed beams. An exact bound: ending here gives
        the answer running on would."""
        if len(self.completed) < self.params.beam_width:
            return False
        lp = self.params.length_penalty
        longest = self.prompt_len + self.params.max_tokens
        best = max(b.cum_logprob / ((longest if lp > 0 else len(b.tokens)) ** lp) for b in self.live)
        return best < self._score(self.completed[-1])

    def step_params(self) -> SamplingParams:
        """One greedy token with the top-K raw logprobs (the prompt's logprobs on the first step)."""
        first = self.steps == 0
        return SamplingParams(
            max_tokens=1,
            temperature=0.0,
            logprobs=self.k,
            prompt_logprobs=self.params.prompt_logprobs if first else None,
            ignore_eos=True,
            logprobs_mode="raw_logprobs",
        )

    def advance(self, positions: Sequence[PositionLogprobs]) -> None:
        """Take one step: ``positions[i]`` is the next-token logprobs of ``live[i]``."""
        if len(positions) != len(self.live):
            raise ValueError(f"{len(positions)} step results for {len(self.live)} live beams")
        params = self.params
        # An ending token may come once the output is min_tokens long (a stop string may end it
        # once the output, its last token included, is: as plain generation's min_tokens).
        may_end = self.steps >= params.min_tokens
        grown: list[BeamSearchSequence] = []
        for beam, position in zip(self.live, positions, strict=True):
            ranked = sorted(position.items(), key=_by_rank)[: self.k]
            for tid, lp in ranked:
                if lp.logprob == -math.inf:
                    continue
                if tid in self._ending:
                    if may_end:
                        self.completed.append(self._ended(beam, tid, lp.logprob, ranked))
                    continue
                grown.append(self._extend(beam, tid, lp.logprob, ranked))
        # All candidates are one token longer than their parents: the score order is the
        # cumulative log-probability's. The sort is stable: ties keep beam, then rank, order.
        grown.sort(key=lambda b: b.cum_logprob, reverse=True)
        live: list[BeamSearchSequence] = []
        for beam in grown:
            if len(live) == params.beam_width:
                break
            if params.stop and self.steps + 1 >= params.min_tokens and self._reached_stop(beam):
                self.completed.append(beam)
            else:
                live.append(beam)
        self.live = live
        # Only the best beam_width completed beams can be in the answer (their scores are final).
        self.completed.sort(key=self._score, reverse=True)
        del self.completed[params.beam_width :]
        self.steps += 1

    def finish(self) -> BeamSearchOutput:
        """The best ``beam_width`` of the completed and live beams, with their text."""
        for beam in self.live:
            beam.finish_reason = "length"
        ranked = sorted(self.completed + self.live, key=self._score, reverse=True)
        best = ranked[: self.params.beam_width]
        for beam in best:
            if beam.text is None:
                beam.text = self._decode(beam.tokens[self.prompt_len :])
        self.live = []
        return BeamSearchOutput(sequences=best)

    # -- helpers ---------------------------------------------------------------------------------

    def _score(self, beam: BeamSearchSequence) -> float:
        length = len(beam.tokens)
        if self.params.include_stop_str_in_output and beam.finish_reason == "stop":
            length -= not isinstance(beam.stop_reason, str)  # its ending token does not count
        return beam_score(length, beam.cum_logprob, self.params.length_penalty)

    def _position(self, tid: int, lp: Logprob, ranked: list[tuple[int, Logprob]]) -> PositionLogprobs:
        entry: PositionLogprobs = {tid: lp}
        for other, olp in ranked[: self.params.logprobs]:
            entry.setdefault(other, olp)
        return entry

    def _extend(
        self, beam: BeamSearchSequence, tid: int, logprob: float, ranked: list[tuple[int, Logprob]]
    ) -> BeamSearchSequence:
        logprobs = beam.logprobs
        if self.params.logprobs is not None:
            logprobs = [*logprobs, self._position(tid, Logprob(logprob, _rank_of(tid, ranked)), ranked)]
        return BeamSearchSequence([*beam.tokens, tid], beam.cum_logprob + logprob, logprobs)

    def _ended(
        self, beam: BeamSearchSequence, tid: int, logprob: float, ranked: list[tuple[int, Logprob]]
    ) -> BeamSearchSequence:
        if self.params.include_stop_str_in_output:
            ended = self._extend(beam, tid, logprob, ranked)
        else:
            ended = BeamSearchSequence(list(beam.tokens), beam.cum_logprob + logprob, list(beam.logprobs))
        ended.finish_reason = "stop"
        # As in plain generation: a stop token id is the stop reason, EOS has none.
        ended.stop_reason = tid if tid in self.params.stop_token_ids else None
        return ended

    def _reached_stop(self, beam: BeamSearchSequence) -> bool:
        """Whether the beam's text now holds a stop string; if so it is ended there (the string
        kept only with ``include_stop_str_in_output``). Live beams never hold one, so any found
        was completed by the last token."""
        text = self._decode(beam.tokens[self.prompt_len :])
        found = [(text.find(s), s) for s in self.params.stop if s in text]
        if not found:
            return False
        at, stop = min(found)
        beam.text = text[: at + len(stop)] if self.params.include_stop_str_in_output else text[:at]
        beam.finish_reason, beam.stop_reason = "stop", stop
        return True

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)


def _by_rank(item: tuple[int, Logprob]) -> tuple[int, float, int]:
    tid, lp = item
    return (lp.rank if lp.rank is not None else 1 << 30, -lp.logprob, tid)


def _rank_of(tid: int, ranked: list[tuple[int, Logprob]]) -> int | None:
    for other, lp in ranked:
        if other == tid:
            return lp.rank
    return None


def completion_output(
    beam: BeamSearchSequence, prompt_len: int, index: int = 0, with_logprobs: bool = False
) -> CompletionOutput:
    """A finished beam as the engine reports a finished sequence."""
    return CompletionOutput(
        index=index,
        text=beam.text or "",
        token_ids=beam.tokens[prompt_len:],
        cumulative_logprob=beam.cum_logprob,
        logprobs=list(beam.logprobs) if with_logprobs else None,
        finish_reason=beam.finish_reason,
        stop_reason=beam.stop_reason,
    )
