"""Sampler: exact processor/filter values, (seed, position)-only randomness, raw logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sampler import (
    Sampler,
    SamplingRow,
    apply_filters,
    process_logits,
    prompt_logprobs,
    row_uniform,
    sample_from_logits,
)
from engine.sampling_params import SamplingParams

PINNED_U00 = 0.5079605879681605  # row_uniform(seed=0, position=0)


def row(
    params: SamplingParams | None = None, seed: int = 0, position: int = 10, prompt=(), output=(), eos=(2,)
) -> SamplingRow:
    return SamplingRow(
        params=params or SamplingParams(),
        seed=seed,
        position=position,
        prompt_token_ids=list(prompt),
        output_token_ids=list(output),
        eos_token_ids=list(eos),
    )


def kept(logits: torch.Tensor) -> list[list[int]]:
    return [torch.nonzero(torch.isfinite(r)).view(-1).tolist() for r in logits]


# -- greedy ------------------------------------------------------------------------------------------


def test_greedy_is_argmax_with_ties_to_lowest_id() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, -0.5, -3.0]])
    out = Sampler(4)(logits, [row(SamplingParams(temperature=0.0)) for _ in range(3)])
    assert out.token_ids == [1, 0, 2]
    assert out.logprobs == [None] * 3 and out.top_logprobs == [None] * 3 and out.ranks == [None] * 3
    # top_k=1 is greedy too, whatever the temperature.
    assert Sampler(4)(
        logits, [row(SamplingParams(temperature=1.5, top_k=1), seed=s) for s in range(3)]
    ).token_ids == [1, 0, 2]


def test_padded_vocab_columns_are_never_chosen() -> None:
    logits = torch.tensor([[0.0, 1.0, 9.0, 50.0]])  # column 3 is embedding padding
    assert Sampler(3)(logits, [row(SamplingParams(temperature=0.0))]).token_ids == [2]
    for seed in range(50):
        assert Sampler(3)(logits, [row(SamplingParams(temperature=5.0), seed=seed)]).token_ids[0] < 3
    out = Sampler(3)(logits, [row(SamplingParams(temperature=0.0, logprobs=5))])
    assert [t for t, _ in out.top_logprobs[0]] == [2, 1, 0]


def test_input_logits_are_not_modified() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    before = logits.clone()
    params = SamplingParams(temperature=0.7, top_k=2, repetition_penalty=1.3, logit_bias={0: 5.0}, min_p=0.1)
    Sampler(4)(logits, [row(params, prompt=[3], output=[1])])
    assert torch.equal(logits, before)


# -- processors (exact values) -----------------------------------------------------------------------


def test_logit_bias_adds_exactly() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]])
    rows = [row(SamplingParams(logit_bias={0: 10.0, 3: -100.0, 99: 5.0})), row()]
    out = process_logits(logits.clone(), rows)
    assert out.tolist() == [[11.0, 2.0, 3.0, -96.0], [1.0, 2.0, 3.0, 4.0]]
    assert Sampler(4)(logits[:1], [row(SamplingParams(temperature=0.0, logit_bias={1: 2.5}))]).token_ids == [
        1
    ]


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.tensor([[0.0, 9.0, 8.0, 7.0, 1.0]])
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[1])
    masked = process_logits(logits.clone(), [row(params, output=[4, 4], eos=(2,))])
    assert masked.tolist() == [[0.0, -math.inf, -math.inf, 7.0, 1.0]]
    assert Sampler(5)(logits, [row(params, output=[4, 4], eos=(2,))]).token_ids == [3]
    assert Sampler(5)(logits, [row(params, output=[4, 4, 4], eos=(2,))]).token_ids == [1]
    # As vLLM: EOS is masked even with ignore_eos.
    ignore = SamplingParams(temperature=0.0, min_tokens=1, ignore_eos=True)
    assert Sampler(5)(torch.tensor([[0.0, 1.0, 9.0, 0.0, 0.0]]), [row(ignore, eos=(2,))]).token_ids == [1]


def test_repetition_penalty_divides_positive_multiplies_negative() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 3.0]])
    params = SamplingParams(repetition_penalty=2.0)
    out = process_logits(logits.clone(), [row(params, prompt=[0, 0], output=[1])])
    assert out.tolist() == [[1.0, -4.0, 1.0, -1.0, 3.0]]


def test_presence_and_frequency_penalties_count_output_tokens_only() -> None:
    logits = torch.zeros(1, 4)
    params = SamplingParams(presence_penalty=0.25, frequency_penalty=0.5)
    out = process_logits(logits.clone(), [row(params, prompt=[3, 3, 3], output=[1, 1, 2])])
    assert out.tolist() == [[0.0, -1.25, -0.75, 0.0]]


def test_penalties_are_per_row_in_a_mixed_batch() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 4.0]] * 3)
    rows = [
        row(SamplingParams(repetition_penalty=2.0), prompt=[0, 0, 7777], output=[1]),  # 7777: not a token
        row(),
        row(
            SamplingParams(repetition_penalty=4.0, frequency_penalty=1.0, presence_penalty=0.5),
            output=[3, 3, 1],
        ),
    ]
    out = process_logits(logits.clone(), rows)
    assert out.tolist() == [
        [1.0, -4.0, 1.0, 4.0],
        [2.0, -2.0, 1.0, 4.0],
        [2.0, -8.0 - 1.5, 1.0, 1.0 - 2.5],
    ]


def test_processors_compose_in_vllm_order() -> None:
    # bias first (+3 -> 1.0), then repetition (1.0 / 2 = 0.5), then frequency (0.5 - 0.5 = 0.0).
    logits = torch.tensor([[-2.0, 0.25, 0.0]])
    params = SamplingParams(logit_bias={0: 3.0}, repetition_penalty=2.0, frequency_penalty=0.5)
    out = process_logits(logits.clone(), [row(params, output=[0])])
    assert out[0, 0].item() == 0.0


# -- filters -----------------------------------------------------------------------------------------


PROBS = [0.5, 0.3, 0.15, 0.05]


def test_top_k_keeps_the_k_largest() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0, -1.0]])
    assert kept(apply_filters(logits, [2], [1.0], [0.0])) == [[1, 2]]
    assert kept(apply_filters(logits, [9], [1.0], [0.0])) == [[0, 1, 2, 3, 4]]


def test_top_p_keeps_the_smallest_head_reaching_p() -> None:
    logits = torch.tensor([PROBS]).log()
    assert kept(apply_filters(logits, [0], [0.7], [0.0])) == [[0, 1]]
    assert kept(apply_filters(logits, [0], [0.85], [0.0])) == [[0, 1, 2]]
    assert kept(apply_filters(logits, [0], [0.4], [0.0])) == [[0]]
    # top_p applies to the distribution renormalised after top_k (0.5, 0.3, 0.15 -> mass before
    # token 2 is 0.8 / 0.95 = 0.842 > 0.82): token 2 goes; without top_k it would stay.
    assert kept(apply_filters(logits, [3], [0.82], [0.0])) == [[0, 1]]
    assert kept(apply_filters(logits, [0], [0.82], [0.0])) == [[0, 1, 2]]


def test_min_p_keeps_tokens_above_fraction_of_max() -> None:
    logits = torch.tensor([PROBS]).log()
    assert kept(apply_filters(logits, [0], [1.0], [0.25])) == [[0, 1, 2]]
    assert kept(apply_filters(logits, [0], [1.0], [0.5])) == [[0, 1]]


def test_min_p_runs_before_top_p_as_in_vllm() -> None:
    # vLLM v1 applies min_p (an argmax-invariant logits processor) before top-k/top-p: min_p 0.5
    # drops 0.2 (< 0.25), top_p 0.6 then keeps 0.5 / 0.8 = 0.625 alone. top_p first would keep
    # {0, 1} (0.5 < 0.6), and min_p after it would keep both.
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    assert kept(apply_filters(logits, [0], [0.6], [0.5])) == [[0]]
    # ... and before top_k: min_p 0.7 leaves token 0 alone, whatever k is.
    assert kept(apply_filters(logits, [2], [1.0], [0.7])) == [[0]]


def test_top_p_beyond_the_fast_head_sorts_the_row() -> None:
    # Row 0 is flat over 1000 tokens, so top_p=0.5 keeps 500, beyond the 256-token head; the
    # slightly higher first 500 make the cut exact. Row 1 is peaked and takes the fast path.
    logits = torch.zeros(2, 1000)
    logits[0, :500] = 1e-3
    logits[1, :10] = 10.0
    out = apply_filters(logits, [0, 0], [0.5, 0.9], [0.0, 0.0])
    assert kept(out) == [list(range(500)), list(range(10))]


def _naive_top_p(row: torch.Tensor, p: float) -> set[int]:
    probs = row.double().softmax(dim=0)
    order = sorted(range(len(probs)), key=lambda i: -probs[i].item())
    keep, mass = set(), 0.0
    for i in order:
        keep.add(i)
        mass += probs[i].item()
        if mass >= p:
            break
    return keep


def test_top_p_matches_a_naive_reference_on_random_rows() -> None:
    gen = torch.Generator().manual_seed(5)
    # Peaked rows (fast 256-token head) and flat ones (full sort), 600 tokens each.
    logits = torch.cat([torch.randn(20, 600, generator=gen) * 4, torch.randn(20, 600, generator=gen) * 0.3])
    ps = torch.rand(40, generator=gen).clamp(0.05, 0.99).tolist()
    out = apply_filters(logits, [0] * 40, ps, [0.0] * 40)
    for r in range(40):
        assert set(kept(out[r : r + 1])[0]) == _naive_top_p(logits[r], ps[r]), r


def test_filters_are_per_row() -> None:
    logits = torch.tensor([PROBS, PROBS, PROBS]).log()
    out = apply_filters(logits, [1, 0, 0], [1.0, 0.7, 1.0], [0.0, 0.0, 0.0])
    assert kept(out) == [[0], [0, 1], [0, 1, 2, 3]]
    # Kept logits are unchanged (no renormalisation leaks into the values).
    assert torch.equal(out[2], logits[2]) and out[1, 1] == logits[1, 1]


def test_sampling_respects_filters() -> None:
    logits = torch.tensor([PROBS]).log()
    rows = [row(SamplingParams(top_p=0.7), seed=s, position=p) for s in range(20) for p in range(10)]
    tokens = Sampler(4)(logits.expand(len(rows), 4), rows).token_ids
    assert set(tokens) == {0, 1}


# -- randomness ----------------------------------------------------------------------------------------


def test_row_uniform_is_a_pure_function_of_seed_and_position() -> None:
    values = {(s, p): row_uniform(s, p) for s in range(100) for p in range(100)}
    assert len(set(values.values())) == 10000
    assert all(0.0 < v < 1.0 for v in values.values())
    assert abs(sum(values.values()) / len(values) - 0.5) < 0.01
    assert row_uniform(2**63 - 1, 10**9) != row_uniform(2**63 - 2, 10**9)
    # Pinned: changing the hash changes every seeded completion users have seen.
    assert row_uniform(0, 0) == PINNED_U00


def test_inverse_cdf_never_draws_masked_tokens() -> None:
    inf = float("-inf")
    logits = torch.tensor([[inf, 0.0, inf, 0.0, inf]] * 4)
    u = torch.tensor([1e-300, 0.5 - 1e-6, 0.5 + 1e-6, 1 - 2**-53], dtype=torch.float64)
    assert sample_from_logits(logits, u).tolist() == [1, 1, 3, 3]
    nothing_left = torch.full((1, 3), inf)
    assert 0 <= sample_from_logits(nothing_left, torch.tensor([0.5], dtype=torch.float64)).item() < 3
    one = torch.tensor([[inf, inf, 5.0]])
    assert sample_from_logits(one, torch.tensor([1 - 2**-53], dtype=torch.float64)).tolist() == [2]


def test_same_seed_and_position_give_same_token_in_any_batch() -> None:
    torch.manual_seed(0)
    vocab = 50
    logits = torch.randn(8, vocab)
    params = [
        SamplingParams(temperature=t, top_p=p, top_k=k, logprobs=2)
        for t, p, k in [(1.0, 1.0, -1), (0.7, 0.9, -1), (1.3, 1.0, 10), (0.0, 1.0, -1)] * 2
    ]
    rows = [row(params[i], seed=100 + i, position=7 * i) for i in range(8)]
    sampler = Sampler(vocab)
    batch = sampler(logits, rows)
    for i in range(8):
        alone = sampler(logits[i : i + 1], [rows[i]])
        assert alone.token_ids == [batch.token_ids[i]]
        assert alone.logprobs == [batch.logprobs[i]] and alone.top_logprobs == [batch.top_logprobs[i]]
    order = [5, 2, 7, 0, 3, 6, 1, 4]
    shuffled = sampler(logits[order], [rows[i] for i in order])
    assert shuffled.token_ids == [batch.token_ids[i] for i in order]
    # The same request row with other neighbours (different params, different sizes).
    mixed = sampler(
        torch.cat([torch.randn(3, vocab), logits[1:2]]),
        [row(SamplingParams(temperature=2.0), seed=s) for s in range(3)] + [rows[1]],
    )
    assert mixed.token_ids[3] == batch.token_ids[1]


def test_different_seeds_and_positions_differ() -> None:
    logits = torch.zeros(1, 1000)  # uniform over 1000 tokens
    by_seed = [Sampler(1000)(logits, [row(seed=s, position=0)]).token_ids[0] for s in range(200)]
    by_pos = [Sampler(1000)(logits, [row(seed=0, position=p)]).token_ids[0] for p in range(200)]
    assert len(set(by_seed)) > 150 and len(set(by_pos)) > 150
    again = [Sampler(1000)(logits, [row(seed=s, position=0)]).token_ids[0] for s in range(200)]
    assert again == by_seed


@pytest.mark.parametrize("temperature,top_k", [(1.0, -1), (0.6, -1), (1.0, 3)])
def test_empirical_distribution_matches_softmax(temperature: float, top_k: int) -> None:
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 1.5])
    n = 40000
    rows = [
        row(SamplingParams(temperature=temperature, top_k=top_k), seed=i // 50, position=i % 50)
        for i in range(n)
    ]
    tokens = torch.tensor(Sampler(8)(base.expand(n, 8), rows).token_ids)
    freq = torch.bincount(tokens, minlength=8).double() / n
    scaled = (base / temperature).double()
    if top_k > 0:
        scaled[scaled < scaled.topk(top_k).values[-1]] = -math.inf
    p = torch.softmax(scaled, dim=0)
    tol = 5 * torch.sqrt(p * (1 - p) / n) + 1e-9
    assert bool(((freq - p).abs() <= tol).all()), (freq.tolist(), p.tolist())


# -- logprobs ------------------------------------------------------------------------------------------


def test_logprobs_ranks_top_n_are_raw_log_softmax() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, 40)
    rows = [
        row(SamplingParams(temperature=0.0, logprobs=0)),
        row(
            SamplingParams(temperature=0.8, logprobs=5, repetition_penalty=1.5, logit_bias={3: 4.0}),
            seed=9,
            output=[1, 2],
        ),
        row(SamplingParams(temperature=1.0)),
    ]
    out = Sampler(40)(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    for i in (0, 1):
        tok = out.token_ids[i]
        assert out.logprobs[i] == raw[i, tok].item()
        assert out.ranks[i] == int((raw[i] > raw[i, tok]).sum()) + 1
    assert out.ranks[0] == 1 and out.top_logprobs[0] == []
    values, ids = raw[1].topk(5)
    assert out.top_logprobs[1] == list(zip(ids.tolist(), values.tolist(), strict=True))
    assert out.logprobs[2] is None and out.top_logprobs[2] is None and out.ranks[2] is None


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"])
def test_logprobs_modes_report_the_distribution_asked_for(mode: str) -> None:
    """vLLM's logprobs modes, exactly: raw = the model's logits; processed = what the row was drawn
    from (penalties, bias; a sampled row's temperature and top-k too: filtered tokens -inf; a
    greedy row's without temperature); *_logprobs their log_softmax, *_logits the values."""
    torch.manual_seed(3)
    logits = torch.randn(3, 40)
    greedy = SamplingParams(temperature=0.0, logprobs=3, logit_bias={5: 2.0})
    sampled = SamplingParams(temperature=0.7, top_k=6, logprobs=8, repetition_penalty=1.3)
    pinned = SamplingParams(temperature=0.7, top_k=6, logprobs=4, logprobs_mode="raw_logprobs")
    rows = [row(greedy), row(sampled, seed=4, output=[7, 8]), row(pinned, seed=5)]
    out = Sampler(40, mode)(logits, rows)
    processed = process_logits(logits.clone(), rows)
    finals = [
        processed[0],
        apply_filters(processed[1:2] / 0.7, top_k=[6], top_p=[1.0], min_p=[0.0])[0],
    ]
    for i in (0, 1):
        src = finals[i] if mode.startswith("processed") else logits[i]
        want = src if mode.endswith("logits") else torch.log_softmax(src, dim=-1)
        tok = out.token_ids[i]
        assert out.logprobs[i] == want[tok].item()
        assert out.ranks[i] == int((want > want[tok]).sum()) + 1
        values, ids = want.topk(rows[i].params.logprobs)
        finite = [(t, v) for t, v in zip(ids.tolist(), values.tolist(), strict=True) if v > -math.inf]
        assert out.top_logprobs[i][: len(finite)] == finite  # -inf ties: lowest ids, any order here
        assert [v for _, v in out.top_logprobs[i]] == values.tolist()
    # top-k 6 of the sampled row: in processed modes the 7th and 8th values reported are -inf.
    cut = [v for _, v in out.top_logprobs[1][6:]]
    assert (cut == [-math.inf, -math.inf]) == mode.startswith("processed")
    # A request that pins its mode (beam search pins raw_logprobs) is reported so in any engine mode.
    raw = torch.log_softmax(logits[2], dim=-1)
    assert out.logprobs[2] == raw[out.token_ids[2]].item()
    # The draw itself never depends on the mode.
    assert out.token_ids == Sampler(40)(logits, rows).token_ids


def test_prompt_logprobs_exact() -> None:
    torch.manual_seed(2)
    logits = torch.randn(4, 30)
    nxt = [5, 0, 29, 7]
    res = prompt_logprobs(logits, nxt, top_n=3)
    raw = torch.log_softmax(logits, dim=-1)
    assert len(res) == 4
    for t, (lp, rank, top) in enumerate(res):
        assert lp == raw[t, nxt[t]].item()
        assert rank == int((raw[t] > raw[t, nxt[t]]).sum()) + 1
        values, ids = raw[t].topk(3)
        assert top == list(zip(ids.tolist(), values.tolist(), strict=True))
    assert prompt_logprobs(logits[:0], [], 3) == []
    assert [r[2] for r in prompt_logprobs(logits, nxt, top_n=0)] == [[], [], [], []]
    padded = torch.cat([logits, torch.full((4, 2), 100.0)], dim=1)
    assert prompt_logprobs(padded, nxt, 3, vocab_size=30) == res
    with pytest.raises(ValueError):
        prompt_logprobs(logits, nxt[:2], 3)


def test_greedy_ties_take_the_first_maximum_like_argmax() -> None:
    from engine.sampler import greedy_tokens

    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0], [0.0, 0.0, 0.0, 2.0]])
    assert greedy_tokens(logits).tolist() == [1, 0, 3]
    many = torch.randint(0, 4, (64, 1000)).float()  # ties in every row
    assert torch.equal(greedy_tokens(many), many.argmax(dim=-1))


def test_allowed_token_ids_keep_only_those_values() -> None:
    logits = torch.arange(10, dtype=torch.float32).repeat(2, 1)
    out = process_logits(logits.clone(), [row(SamplingParams(allowed_token_ids=[2, 5, 40])), row()])
    assert kept(out) == [[2, 5], list(range(10))]  # an id past the vocabulary is ignored
    assert out[0, 2].item() == 2.0 and out[0, 5].item() == 5.0


def test_bad_words_mask_the_token_that_would_complete_them() -> None:
    params = SamplingParams(bad_words_token_ids=[[7], [3, 4, 9], [1, 8]])
    logits = torch.zeros(3, 10)
    rows = [row(params, output=[5, 3, 4]), row(params, output=[3, 5]), row(params, output=[])]
    out = process_logits(logits, rows)
    # 7 always; 9 after "3 4"; 8 never here ("1" did not just come).
    assert [sorted(set(range(10)) - set(k)) for k in kept(out)] == [[7, 9], [7], [7]]


def test_contradicting_masks_give_way_never_an_arbitrary_token() -> None:
    # Row 0: allowed ids all masked by a bad word on the fly ([4, 7] after 4): nothing is left, so
    # the row samples from the unprocessed logits. Row 1: untouched.
    logits = torch.tensor(
        [[0.0, 1.0, 5.0, 2.0, 3.0, 0.5, 0.0, 4.0], [0.0, 1.0, 5.0, 2.0, 3.0, 0.5, 0.0, 4.0]]
    )
    params = SamplingParams(temperature=0.0, allowed_token_ids=[7], bad_words_token_ids=[[4, 7]])
    out = Sampler(8)(logits, [row(params, output=[4]), row(SamplingParams(temperature=0.0))])
    assert out.token_ids == [2, 2]
    with pytest.raises(ValueError, match="every token in allowed_token_ids is a bad word"):
        SamplingParams(allowed_token_ids=[3, 5], bad_words_token_ids=[[3], [5], [1, 2]]).validate()
