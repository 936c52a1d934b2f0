"""A request's ``allowed_token_ids`` and ``bad_words`` are read at every step it samples, in the
engine loop that every request of the batch waits on: a long list must be walked once per request,
not once per step (50k bad words cost ~90 ms a step, for the whole batch, before). The lists below
count how often they are walked; the masks are checked against what the short lists give."""

from __future__ import annotations

import torch

from engine.sampler import SamplingRow, process_logits
from engine.sampling_params import SamplingParams


class CountedList(list):
    """A list that counts the passes over it (``__iter__``: for-loops, comprehensions, ``set()``)."""

    def __init__(self, items: list) -> None:
        super().__init__(items)
        self.passes = 0

    def __iter__(self):  # noqa: ANN204
        self.passes += 1
        return super().__iter__()


def _row(params: SamplingParams, output: list[int]) -> SamplingRow:
    return SamplingRow(
        params=params, seed=0, position=10, prompt_token_ids=[], output_token_ids=output, eos_token_ids=[2]
    )


def _kept(logits: torch.Tensor) -> list[int]:
    return torch.nonzero(torch.isfinite(logits[0])).view(-1).tolist()


STEPS = 20


def test_bad_words_are_indexed_once_per_request() -> None:
    # 5 and 9 banned always; 7 after "3 4"; 8 after "6"; words naming ids past the vocabulary ignored.
    words = CountedList([[5], [3, 4, 7], [6, 8], [9], [1, 99], [99]] + [[11, 12, 13]] * 1000)
    params = SamplingParams(bad_words_token_ids=words)
    outputs = [[], [3, 4], [0, 6], [3], [4, 3, 4], [6, 6]]
    expected = [[5, 9], [5, 7, 9], [5, 8, 9], [5, 9], [5, 7, 9], [5, 8, 9]]
    for step in range(STEPS):
        out = outputs[step % len(outputs)]
        logits = process_logits(torch.zeros(1, 10), [_row(params, out)])
        assert sorted(set(range(10)) - set(_kept(logits))) == expected[step % len(outputs)]
    assert words.passes == 1


def test_allowed_ids_are_collected_once_per_request() -> None:
    allowed = CountedList([2, 5, 40, 5, -1] * 1000)  # repeats, one id past the vocabulary, one negative
    params = SamplingParams(allowed_token_ids=allowed)
    for _ in range(STEPS):
        logits = process_logits(torch.arange(10, dtype=torch.float32).view(1, 10), [_row(params, [])])
        assert _kept(logits) == [2, 5]
        assert logits[0, 2].item() == 2.0 and logits[0, 5].item() == 5.0
    assert allowed.passes == 1
