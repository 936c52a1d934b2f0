"""Turns a batch of next-token logits into token ids, and reports logprobs.

Processing order (as vLLM v1): logit_bias -> min_tokens (EOS and stop ids masked) -> repetition
penalty (prompt + output tokens) -> presence / frequency penalties (output tokens) -> greedy
argmax, or temperature -> top_k -> top_p -> min_p -> sample. Reported logprobs, ranks and top-N
come from the *raw* distribution (log_softmax of the unprocessed logits), as in vLLM v1.

Randomness comes only from each row's ``(seed, position)``: the noise for token ``t`` is a
counter-based hash of ``(seed, position, t)`` computed with integer tensor ops, so a row draws the
same token alone, in any batch, in any order, and when resumed on another machine at the same
position. Sampling is the Gumbel-max trick, ``argmax(logits / T + g)`` with
``g = -log(-log(u))``, which is exactly a draw from ``softmax(logits / T)`` and needs no host sync.
Never use a shared ``torch.Generator`` here: that would tie a row's draw to its batch neighbours.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _signed(x: int) -> int:
    """A 64-bit pattern as the signed int64 torch stores."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors, in place (multiplication wraps mod 2**64)."""
    for shift, mult in ((30, _MIX1), (27, _MIX2), (31, None)):
        z ^= _shr(z, shift)
        if mult is not None:
            z *= _signed(mult)
    return z


def row_key(seed: int, position: int) -> int:
    """The 64-bit stream key of one (seed, position), as a signed int64."""
    z = (seed * _GOLDEN + position * _MIX2 + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return _signed(z ^ (z >> 31))


def uniform_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """U(0, 1) float32 ``[len(keys), vocab_size]``, a pure function of each key and token id."""
    token = torch.arange(vocab_size, device=keys.device, dtype=torch.int64) * _signed(_GOLDEN)
    return bits_to_uniform(_mix(keys.view(-1, 1) + token.view(1, -1)))


def bits_to_uniform(bits: torch.Tensor) -> torch.Tensor:
    """int64 bit patterns -> float32 in (0, 1). The top 23 bits + 0.5 fit float32's 24-bit
    significand exactly, so both ends stay excluded (u == 1 would give a token infinite noise)."""
    return (_shr(bits, 41).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


@dataclass
class SamplingRow:
    params: SamplingParams
    seed: int
    position: int  # index of the token being sampled in the request's full sequence (prompt + output)
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # generated so far
    eos_token_ids: Sequence[int]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float | None]  # of the sampled token, raw distribution; None when not asked
    top_logprobs: list[list[tuple[int, float]] | None]  # top-N (id, raw logprob), descending
    ranks: list[int | None]  # 1-based rank of the sampled token in the raw distribution


class Sampler:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
        # Padded embedding rows past the vocabulary are not tokens: never sample or report them.
        logits = logits[:, : self.vocab_size].float()
        raw = logits
        processed = process_logits(logits.clone(), rows) if _needs_processing(rows) else logits

        greedy = [r.params.greedy for r in rows]
        if all(greedy):
            tokens = processed.argmax(dim=-1)
        else:
            tokens = _sample(processed, rows, greedy)
        return _build_output(raw, tokens, rows)


def _needs_processing(rows: list[SamplingRow]) -> bool:
    for r in rows:
        p = r.params
        if (
            p.logit_bias
            or (p.min_tokens and len(r.output_token_ids) < p.min_tokens)
            or p.repetition_penalty != 1.0
            or p.presence_penalty
            or p.frequency_penalty
        ):
            return True
    return False


def _index(
    pairs_rows: list[int], pairs_ids: list[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.tensor(pairs_rows, dtype=torch.long, device=device),
        torch.tensor(pairs_ids, dtype=torch.long, device=device),
    )


def process_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The logit processors that change the argmax, in vLLM's order; ``logits`` is modified in place."""
    vocab = logits.shape[1]
    device = logits.device

    bias_rows, bias_ids, bias_vals = [], [], []
    mask_rows, mask_ids = [], []
    for i, r in enumerate(rows):
        p = r.params
        if p.logit_bias:
            for tok, bias in p.logit_bias.items():
                tok = int(tok)
                if 0 <= tok < vocab:
                    bias_rows.append(i)
                    bias_ids.append(tok)
                    bias_vals.append(float(bias))
        if p.min_tokens and len(r.output_token_ids) < p.min_tokens:
            # As vLLM: EOS is masked even with ignore_eos (it could not stop the request anyway).
            for tok in {*r.eos_token_ids, *p.stop_token_ids}:
                if 0 <= tok < vocab:
                    mask_rows.append(i)
                    mask_ids.append(tok)
    if bias_rows:
        r_idx, t_idx = _index(bias_rows, bias_ids, device)
        logits.index_put_(
            (r_idx, t_idx), torch.tensor(bias_vals, dtype=logits.dtype, device=device), accumulate=True
        )
    if mask_rows:
        logits[_index(mask_rows, mask_ids, device)] = float("-inf")

    rep = [(i, r) for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if rep:
        seen = torch.zeros(len(rep), vocab, dtype=torch.bool, device=device)
        seq_rows, seq_ids = [], []
        for j, (_, r) in enumerate(rep):
            ids = [*r.prompt_token_ids, *r.output_token_ids]
            seq_rows += [j] * len(ids)
            seq_ids += ids
        if seq_ids:
            seen[_index(seq_rows, seq_ids, device)] = True
        idx = torch.tensor([i for i, _ in rep], dtype=torch.long, device=device)
        penalty = torch.tensor(
            [r.params.repetition_penalty for _, r in rep], dtype=logits.dtype, device=device
        ).view(-1, 1)
        sub = logits[idx]
        penalised = torch.where(sub > 0, sub / penalty, sub * penalty)
        logits[idx] = torch.where(seen, penalised, sub)

    pen = [(i, r) for i, r in enumerate(rows) if r.params.presence_penalty or r.params.frequency_penalty]
    if pen:
        counts = torch.zeros(len(pen), vocab, dtype=logits.dtype, device=device)
        out_rows, out_ids = [], []
        for j, (_, r) in enumerate(pen):
            out_rows += [j] * len(r.output_token_ids)
            out_ids += list(r.output_token_ids)
        if out_ids:
            r_idx, t_idx = _index(out_rows, out_ids, device)
            counts.index_put_(
                (r_idx, t_idx), torch.ones(len(out_ids), dtype=logits.dtype, device=device), accumulate=True
            )
        idx = torch.tensor([i for i, _ in pen], dtype=torch.long, device=device)
        freq = torch.tensor([r.params.frequency_penalty for _, r in pen], dtype=logits.dtype, device=device)
        pres = torch.tensor([r.params.presence_penalty for _, r in pen], dtype=logits.dtype, device=device)
        logits[idx] = (
            logits[idx] - freq.view(-1, 1) * counts - pres.view(-1, 1) * (counts > 0).to(logits.dtype)
        )
    return logits


def _sample(logits: torch.Tensor, rows: list[SamplingRow], greedy: list[bool]) -> torch.Tensor:
    """Greedy rows take the argmax; the others a seeded Gumbel-max draw after the filters."""
    device = logits.device
    tokens = logits.argmax(dim=-1)
    rand = [i for i, g in enumerate(greedy) if not g]
    idx = torch.tensor(rand, dtype=torch.long, device=device)
    params = [rows[i].params for i in rand]
    temp = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device).view(-1, 1)
    scaled = logits[idx] / temp
    scaled = apply_filters(
        scaled,
        top_k=[p.top_k if p.top_k > 0 else 0 for p in params],
        top_p=[p.top_p for p in params],
        min_p=[p.min_p for p in params],
    )
    keys = torch.tensor(
        [row_key(rows[i].seed, rows[i].position) for i in rand], dtype=torch.int64, device=device
    )
    gumbel = -torch.log(-torch.log(uniform_noise(keys, logits.shape[1])))
    tokens[idx] = (scaled + gumbel).argmax(dim=-1)
    return tokens


def apply_filters(
    logits: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float], min_p: Sequence[float]
) -> torch.Tensor:
    """top_k (0: off; ties with the k-th value are kept) -> top_p (the smallest head whose mass
    reaches p, renormalised after top_k) -> min_p (prob >= min_p * max prob). Removed logits become
    -inf. Rows with every filter off are returned unchanged."""
    use_k, use_p, use_min = any(top_k), any(p < 1.0 for p in top_p), any(m > 0.0 for m in min_p)
    if not (use_k or use_p or use_min):
        return logits
    device, vocab = logits.device, logits.shape[1]
    if use_k or use_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        if use_k:
            k = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_k], device=device).view(-1, 1)
            kth = sorted_logits.gather(1, k - 1)
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
        if use_p:
            p = torch.tensor(list(top_p), dtype=logits.dtype, device=device).view(-1, 1)
            probs = sorted_logits.softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            # The first token always stays: its mass_before is 0 < p.
            sorted_logits = sorted_logits.masked_fill(mass_before >= p, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    if use_min:
        m = torch.tensor(list(min_p), dtype=logits.dtype, device=device).view(-1, 1)
        probs = logits.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * m
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def _build_output(raw: torch.Tensor, tokens: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
    n = len(rows)
    token_ids = tokens.tolist()
    logprobs: list[float | None] = [None] * n
    top: list[list[tuple[int, float]] | None] = [None] * n
    ranks: list[int | None] = [None] * n
    asked = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if asked:
        idx = torch.tensor(asked, dtype=torch.long, device=raw.device)
        lp, rk, tops = _logprob_stats(raw[idx], tokens[idx], max(rows[i].params.logprobs for i in asked))
        for j, i in enumerate(asked):
            logprobs[i], ranks[i] = lp[j], rk[j]
            top[i] = tops[j][: rows[i].params.logprobs]
    return SamplerOutput(token_ids=token_ids, logprobs=logprobs, top_logprobs=top, ranks=ranks)


def _logprob_stats(
    logits: torch.Tensor, chosen: torch.Tensor, top_n: int
) -> tuple[list[float], list[int], list[list[tuple[int, float]]]]:
    """Raw logprob of ``chosen`` per row, its 1-based rank (1 + ids strictly more likely), top-N."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen_lp = logp.gather(1, chosen.view(-1, 1))
    rank = (logp > chosen_lp).sum(dim=-1) + 1
    top_n = min(top_n, logp.shape[1])
    tops: list[list[tuple[int, float]]] = [[] for _ in range(logp.shape[0])]
    if top_n > 0:
        values, ids = logp.topk(top_n, dim=-1)
        for j, (vs, ts) in enumerate(zip(values.tolist(), ids.tolist(), strict=True)):
            # Stable order for equal logprobs: lower id first.
            tops[j] = sorted(zip(ts, vs, strict=True), key=lambda tv: (-tv[1], tv[0]))
    return chosen_lp.view(-1).tolist(), rank.tolist(), tops


def prompt_logprobs(
    logits: torch.Tensor, next_token_ids: Sequence[int], top_n: int, vocab_size: int | None = None
) -> list[tuple[float, int, list[tuple[int, float]]]]:
    """For each position: the raw logprob of the token that actually came next, its rank, the top-N.

    ``logits[t]`` is the distribution after the prompt's first ``t + 1`` tokens, so it scores
    ``next_token_ids[t]`` (= prompt token ``t + 1``). Columns past ``vocab_size`` (embedding
    padding) are left out.
    """
    if logits.shape[0] != len(next_token_ids):
        raise ValueError(f"{logits.shape[0]} positions of logits for {len(next_token_ids)} next tokens")
    if not next_token_ids:
        return []
    if vocab_size is not None:
        logits = logits[:, :vocab_size]
    chosen = torch.tensor(list(next_token_ids), dtype=torch.long, device=logits.device)
    lp, rk, tops = _logprob_stats(logits, chosen, top_n)
    return list(zip(lp, rk, tops, strict=True))
