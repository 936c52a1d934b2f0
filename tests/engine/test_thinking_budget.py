"""``thinking_token_budget`` (vLLM's): the tracker that counts a thought's tokens and names the end
marker token forced once the budget is spent, the sampler forcing it, and the offline ``LLM`` with a
tiny model whose tokenizer has ``<think>`` and ``</think>`` (exact token ids)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from engine.sampler import Sampler, SamplingRow
from engine.sampling_params import SamplingParams
from engine.thinking_budget import ThinkingTracker

START, END = [7], [8, 9]  # a one-token start marker, a two-token end marker


def _forced(tracker: ThinkingTracker, tokens: list[int]) -> list[int | None]:
    """The forced token before each of ``tokens`` is appended, then after the last."""
    out: list[int | None] = []
    for tok in tokens:
        out.append(tracker.forced_token(tracker.output))
        tracker.output.append(tok)
    out.append(tracker.forced_token(tracker.output))
    return out


def test_a_thought_the_prompt_opened_counts_its_prompt_tokens() -> None:
    # The prompt ends "<start> 5": one thinking token already, so a budget of 3 leaves two.
    t = ThinkingTracker(3, START, END, [1, 2, 7, 5], [])
    assert _forced(t, [20, 21, 8, 9, 30]) == [None, None, 8, 9, None, None]


def test_a_budget_of_zero_ends_at_once_and_a_closed_prompt_is_free() -> None:
    assert ThinkingTracker(0, START, END, [1, 7], []).forced_token([]) == 8
    # The prompt's thought was closed (<start> ... <end>): nothing is counted until a new start.
    t = ThinkingTracker(0, START, END, [7, 3, 8, 9, 4], [])
    assert _forced(t, [20, 21]) == [None, None, None]


def test_a_thought_the_model_opens_is_counted_from_its_start() -> None:
    t = ThinkingTracker(2, START, END, [1, 2], [])
    # free until <start>, then two thinking tokens, then the end marker's two tokens, then free.
    assert _forced(t, [3, 7, 10, 11, 8, 9, 12]) == [None, None, None, None, 8, 9, None, None]


def test_a_thought_closed_in_time_is_not_cut_and_a_new_one_counts_from_zero() -> None:
    # (The end marker's first token counts as thinking until the marker is whole, as in vLLM.)
    t = ThinkingTracker(3, START, END, [7], [])
    assert _forced(t, [10, 8, 9, 7, 11]) == [None, None, None, None, None, None]
    assert _forced(t, [12, 13]) == [None, None, 8]


def test_drafts_are_walked_without_moving_the_state() -> None:
    t = ThinkingTracker(2, START, END, [7], [])
    assert t.forced_token([10, 11]) == 8  # two drafts spend the budget: the end comes after them
    assert t.forced_token([10]) is None  # the drafts were not kept
    t.output.extend([10, 11])
    assert t.forced_token(t.output) == 8


def test_bad_budgets_are_refused() -> None:
    for bad in (-2, True, 1.5, "3"):
        with pytest.raises(ValueError, match="thinking_token_budget must be a non-negative integer"):
            SamplingParams(thinking_token_budget=bad).validate()
    assert SamplingParams(thinking_token_budget=-1).thinking_token_budget is None  # vLLM's unlimited


def _row(params: SamplingParams, tracker: ThinkingTracker | None) -> SamplingRow:
    return SamplingRow(params, 1, 4, [1, 7], tracker.output if tracker else [], (0,), thinking=tracker)


def test_the_sampler_draws_the_forced_token_greedy_and_sampled() -> None:
    logits = torch.zeros(3, 12)
    logits[:, 3] = 9.0  # every row's favourite
    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_p=0.5)
    rows = [
        _row(greedy, ThinkingTracker(0, START, END, [1, 7], [])),
        _row(sampled, ThinkingTracker(0, START, END, [1, 7], [])),
        _row(greedy, None),
    ]
    out = Sampler(12, "raw_logprobs")(logits, rows)
    assert out.token_ids == [8, 8, 3]


@dataclasses.dataclass(frozen=True)
class Thinker:
    """A tiny model whose tokenizer has ``<think>`` and ``</think>``, one token each."""

    model: Path
    tok: object
    start: int
    end: int


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Thinker:
    from engine.demo import build_model
    from engine.tokenizer import Tokenizer

    model = build_model(
        tmp_path_factory.mktemp("thinker"), "llama", seed=5, extra_tokens=("<think>", "</think>")
    )
    tok = Tokenizer.from_dir(model)
    (start,) = tok.encode("<think>", add_special_tokens=False)
    (end,) = tok.encode("</think>", add_special_tokens=False)
    return Thinker(model, tok, start, end)


def test_the_offline_llm_ends_the_thinking_after_the_budget(thinker: Thinker) -> None:
    from engine import LLM

    model, tok, start, end = thinker.model, thinker.tok, thinker.start, thinker.end
    prompt = [*tok.encode("hello there", add_special_tokens=False), start]
    llm = LLM(str(model))
    # </think> biased away: this greedy model would think through all ten tokens on its own.
    free = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logit_bias={end: -100.0})
    thinking = llm.generate([prompt], free)[0].outputs[0].token_ids
    assert end not in thinking
    for k in (0, 3):
        capped = dataclasses.replace(free, thinking_token_budget=k)
        ids = llm.generate([prompt], capped)[0].outputs[0].token_ids
        assert ids[: k + 1] == [*thinking[:k], end] and len(ids) == 10
        assert end not in ids[k + 1 :]


def test_speculative_drafts_never_think_past_the_budget(thinker: Thinker) -> None:
    # n-gram drafts run ahead of the budget: each draft's row is forced as the real token would be,
    # so a speculative engine writes exactly the tokens a plain one does.
    from engine import LLM

    model, tok, start, end = thinker.model, thinker.tok, thinker.start, thinker.end
    # This greedy model repeats itself after ten thoughts: its drafts are taken from there on.
    prompt = [*tok.encode("hello hello hello", add_special_tokens=False), start]
    plain = LLM(str(model))
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    spec = LLM(str(model), speculative_config=ngram)
    for k in (2, 16, 17):  # 16 and 17 end the thinking where accepted drafts would have gone on
        params = SamplingParams(
            max_tokens=24, temperature=0, ignore_eos=True, logit_bias={end: -100.0}, thinking_token_budget=k
        )
        ids = plain.generate([prompt], params)[0].outputs[0].token_ids
        assert ids.index(end) == k and spec.generate([prompt], params)[0].outputs[0].token_ids == ids
    assert spec.engine.spec_accepted_tokens > 0
