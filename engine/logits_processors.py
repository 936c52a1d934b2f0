"""The logit processors that change which token wins, applied by ``engine/sampler.py`` before it
draws: ``allowed_token_ids``, ``bad_words``, ``logit_bias``, ``min_tokens`` (EOS and stop ids
masked), the repetition penalty and the presence / frequency penalties, in vLLM v1's order, then a
spent ``thinking_token_budget``'s end marker forced (``engine/thinking_budget.py``). They
stand apart from the draw itself (temperature, top-k/top-p/min-p, the ``(seed, position)``
uniform) and from logprob reporting: each touches only the (row, token) pairs concerned, never a
whole ``[B, V]`` pass, and what a request's long lists index is built once per request.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import TYPE_CHECKING

import torch

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.sampler import SamplingRow


def _needs_processing(rows: list[SamplingRow]) -> bool:
    for r in rows:
        p = r.params
        if (
            p.logit_bias
            or p.allowed_token_ids
            or p.bad_words_token_ids
            or (p.min_tokens and len(r.output_token_ids) < p.min_tokens)
            or p.repetition_penalty != 1.0
            or p.presence_penalty
            or p.frequency_penalty
            # a spent thinking budget (only the steps that force a token: the rest pay no clone)
            or (r.thinking is not None and r.thinking.forced_token(r.output_token_ids) is not None)
        ):
            return True
    return False


def _index(rows: list[int], ids: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.tensor(rows, dtype=torch.long, device=device),
        torch.tensor(ids, dtype=torch.long, device=device),
    )


def process_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The logit processors that change the argmax, in vLLM's order; ``logits`` is modified in place.

    Every update touches only the (row, token) pairs concerned, never a whole ``[B, V]`` pass
    (``allowed_token_ids`` rewrites its own rows: everything but the allowed ids goes).
    """
    vocab, device = logits.shape[1], logits.device
    _allowed_and_bad_words(logits, rows)

    bias_rows, bias_ids, bias_vals = [], [], []
    mask_rows, mask_ids = [], []
    for i, r in enumerate(rows):
        p = r.params
        if p.logit_bias:
            for tok, bias in p.logit_bias.items():
                if 0 <= int(tok) < vocab:
                    bias_rows.append(i)
                    bias_ids.append(int(tok))
                    bias_vals.append(float(bias))
        if p.min_tokens and len(r.output_token_ids) < p.min_tokens:
            # As vLLM: EOS is masked even with ignore_eos (it could not stop the request anyway).
            for tok in {*r.eos_token_ids, *p.stop_token_ids}:
                if 0 <= tok < vocab:
                    mask_rows.append(i)
                    mask_ids.append(tok)
    if bias_rows:
        biases = torch.tensor(bias_vals, dtype=logits.dtype, device=device)
        logits.index_put_(_index(bias_rows, bias_ids, device), biases, accumulate=True)
    if mask_rows:
        logits[_index(mask_rows, mask_ids, device)] = float("-inf")

    rep = [(i, r) for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if rep:
        where, _ = _unique_pairs(
            [i for i, _ in rep], [(r.prompt_token_ids, r.output_token_ids) for _, r in rep], vocab, device
        )
        per_row = torch.ones(len(rows), dtype=logits.dtype, device=device)
        per_row[[i for i, _ in rep]] = torch.tensor(
            [r.params.repetition_penalty for _, r in rep], dtype=logits.dtype, device=device
        )
        penalty = per_row[where[0]]
        values = logits[where]
        logits[where] = torch.where(values > 0, values / penalty, values * penalty)

    pen = [(i, r) for i, r in enumerate(rows) if (r.params.presence_penalty or r.params.frequency_penalty)]
    if pen:
        where, counts = _unique_pairs(
            [i for i, _ in pen], [(r.output_token_ids,) for _, r in pen], vocab, device
        )
        freq = torch.zeros(len(rows), dtype=logits.dtype, device=device)
        pres = torch.zeros(len(rows), dtype=logits.dtype, device=device)
        freq[[i for i, _ in pen]] = torch.tensor(
            [r.params.frequency_penalty for _, r in pen], dtype=logits.dtype, device=device
        )
        pres[[i for i, _ in pen]] = torch.tensor(
            [r.params.presence_penalty for _, r in pen], dtype=logits.dtype, device=device
        )
        logits[where] -= freq[where[0]] * counts.to(logits.dtype) + pres[where[0]]
    _force_thinking_end(logits, rows)
    return logits


def _force_thinking_end(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Rows whose ``thinking_token_budget`` is spent draw their end marker's next token: it alone
    keeps a (finite) logit, whatever the masks and biases before said, so greedy and seeded draws
    alike take it."""
    for i, r in enumerate(rows):
        if r.thinking is None:
            continue
        token = r.thinking.forced_token(r.output_token_ids)
        if token is not None and 0 <= token < logits.shape[1]:
            logits[i] = float("-inf")
            logits[i, token] = 0.0


def _allowed_and_bad_words(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """vLLM's first processors: ``allowed_token_ids`` (everything else -inf), then ``bad_words``
    (the last token of a bad word whose other tokens end the output so far)."""
    vocab, device = logits.shape[1], logits.device
    for i, r in enumerate(rows):
        if r.params.allowed_token_ids:
            keep = torch.tensor(_allowed_ids(r.params, vocab), dtype=torch.long, device=device)
            row = torch.full((vocab,), float("-inf"), dtype=logits.dtype, device=device)
            row[keep] = logits[i, keep]
            logits[i] = row
        if r.params.bad_words_token_ids:
            single, by_prefix = _bad_words_index(r.params, vocab)
            out = r.output_token_ids
            banned = list(single)
            for k, last_tokens in by_prefix.items():  # one lookup per prefix length, not per word
                if len(out) >= k:
                    banned += last_tokens.get(tuple(out[len(out) - k :]), ())
            if banned:
                logits[i, torch.tensor(banned, dtype=torch.long, device=device)] = float("-inf")


# A request's allowed ids and bad words are read every step it samples: what they index is built
# once per request (kept in its params' ``__dict__``, outside the dataclass fields), so a request
# with a long list costs each step of the whole batch one lookup per prefix length instead of a
# Python pass over every id or word (a 50k-word list cost ~90 ms a step).
_ALLOWED_KEY = "_allowed_ids"
_BAD_WORDS_KEY = "_bad_words_index"


def _allowed_ids(params: SamplingParams, vocab: int) -> list[int]:
    cached = params.__dict__.get(_ALLOWED_KEY)
    if cached is None or cached[0] != vocab:
        cached = (vocab, sorted({t for t in params.allowed_token_ids or () if 0 <= t < vocab}))
        params.__dict__[_ALLOWED_KEY] = cached
    return cached[1]


def _bad_words_index(
    params: SamplingParams, vocab: int
) -> tuple[list[int], dict[int, dict[tuple[int, ...], list[int]]]]:
    """(the one-token bad words, {prefix length: {prefix: the last tokens it bans}}), ids outside
    the vocabulary left out."""
    cached = params.__dict__.get(_BAD_WORDS_KEY)
    if cached is None or cached[0] != vocab:
        single: set[int] = set()
        by_prefix: dict[int, dict[tuple[int, ...], list[int]]] = {}
        for seq in params.bad_words_token_ids or ():
            if not 0 <= seq[-1] < vocab:
                continue
            if len(seq) == 1:
                single.add(seq[0])
            else:
                by_prefix.setdefault(len(seq) - 1, {}).setdefault(tuple(seq[:-1]), []).append(seq[-1])
        cached = (vocab, (sorted(single), by_prefix))
        params.__dict__[_BAD_WORDS_KEY] = cached
    return cached[1]


def _unique_pairs(
    row_ids: list[int], token_lists: list[tuple[Sequence[int], ...]], vocab: int, device: torch.device
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Distinct (row, token) pairs over each row's token lists, with how often each occurs.

    Vectorised (one ``torch.unique`` over ``row * vocab + token``): the per-token work stays out
    of Python even for long prompts. Ids outside the vocabulary are ignored.
    """
    flat = list(chain.from_iterable(chain.from_iterable(lists) for lists in token_lists))
    lengths = [sum(len(t) for t in lists) for lists in token_lists]
    tokens = torch.tensor(flat, dtype=torch.long, device=device)
    rows = torch.repeat_interleave(
        torch.tensor(row_ids, dtype=torch.long, device=device),
        torch.tensor(lengths, dtype=torch.long, device=device),
    )
    valid = (tokens >= 0) & (tokens < vocab)
    keys, counts = torch.unique(rows[valid] * vocab + tokens[valid], return_counts=True)
    return (keys // vocab, keys % vocab), counts
