"""Beam search (``engine/beam_search.py``, ``LLM.beam_search``): the beams of transformers' own beam
search where the two algorithms agree (no beam ends early), vLLM's algorithm written out plainly
over transformers' full distributions where beams end, and the search's rules on hand-made steps."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from engine import LLM, BeamSearchParams
from engine.beam_search import BeamSearch
from engine.outputs import Logprob
from engine.tokenizer import Tokenizer

PROMPTS = [[5, 9, 14, 3, 77], [400, 12, 800, 33, 7, 91, 250, 61, 17, 500, 42, 8, 311, 29, 640, 71, 99]]


@pytest.fixture(scope="module")
def llm(tiny_llama: Path):
    with LLM(str(tiny_llama), num_kv_blocks=128, num_threads=1) as llm:
        yield llm


@pytest.mark.parametrize("width", [1, 3])
def test_beams_equal_transformers_beam_search(llm, hf_model, tiny_llama: Path, width: int) -> None:
    # Without an ending token both algorithms keep the `width` most likely continuations each step.
    model = hf_model(tiny_llama)
    outs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=width, max_tokens=8, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                num_beams=width,
                num_return_sequences=width,
                do_sample=False,
                max_new_tokens=8,
                eos_token_id=None,
                pad_token_id=0,
                return_dict_in_generate=True,
                output_scores=True,
            )
        assert [s.tokens for s in out.sequences] == ref.sequences.tolist()
        assert all(s.tokens[: len(prompt)] == prompt and s.finish_reason == "length" for s in out.sequences)
        if width > 1:  # transformers' score: the output's log-probability over its length
            scores = [s.cum_logprob / 8 for s in out.sequences]
            assert scores == pytest.approx(ref.sequences_scores.tolist(), abs=1e-4)
    greedy = llm.generate(PROMPTS[0], _greedy(8))[0].outputs[0].token_ids
    if width == 1:
        assert outs[0].sequences[0].tokens[len(PROMPTS[0]) :] == greedy
    else:  # vLLM's concurrency_limit: one prompt's search at a time, the same beams
        params = BeamSearchParams(beam_width=width, max_tokens=8, ignore_eos=True)
        one_by_one = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params, concurrency_limit=1)
        assert [[s.tokens for s in o.sequences] for o in one_by_one] == [
            [s.tokens for s in o.sequences] for o in outs
        ]


def _greedy(max_tokens: int):
    from engine import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def reference_beam_search(
    model,
    prompt: list[int],
    width: int,
    max_tokens: int,
    ending: set[int],
    min_tokens: int = 0,
    length_penalty: float = 1.0,
    include_ending: bool = False,
) -> list[tuple[list[int], float, bool]]:
    """vLLM's algorithm, every step run (no early end), over the full distribution of each beam:
    (output tokens, cumulative logprob, ended by a token) of the best ``width``."""
    live: list[tuple[list[int], float]] = [(list(prompt), 0.0)]
    completed: list[tuple[list[int], float, bool]] = []
    k = max(2 * width, width + len(ending))
    for step in range(max_tokens):
        grown = []
        for tokens, cum in live:
            with torch.no_grad():
                logits = model(torch.tensor([tokens])).logits[0, -1].float()
            values, ids = torch.log_softmax(logits, -1).topk(k)
            for lp, tid in zip(values.tolist(), ids.tolist(), strict=True):
                if tid in ending:
                    if step >= min_tokens:
                        completed.append((tokens + [tid] if include_ending else tokens, cum + lp, True))
                else:
                    grown.append((tokens + [tid], cum + lp))
        grown.sort(key=lambda c: -c[1])
        live = grown[:width]
    pool = completed + [(t, c, False) for t, c in live]

    def score(item: tuple[list[int], float, bool]) -> float:
        tokens, cum, ended = item
        return cum / (len(tokens) - int(ended and include_ending)) ** length_penalty

    pool.sort(key=score, reverse=True)
    return [(t[len(prompt) :], c, e) for t, c, e in pool[:width]]


def _likely_tokens(model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1]
    return logits.topk(4).indices.tolist()


@pytest.mark.parametrize(
    ("min_tokens", "length_penalty", "include"), [(0, 1.0, False), (2, 0.0, True), (0, -0.5, False)]
)
def test_stop_tokens_end_beams_as_the_reference(
    llm, hf_model, tiny_llama: Path, min_tokens, length_penalty, include
) -> None:
    model = hf_model(tiny_llama)
    prompt = PROMPTS[1]
    # The second most likely token where the greedy beam may first end ends a beam: some beams
    # end there, others later.
    greedy = llm.generate(prompt, _greedy(max(min_tokens, 1)))[0].outputs[0].token_ids
    stop = _likely_tokens(model, prompt + greedy[:min_tokens])[1]
    params = BeamSearchParams(
        beam_width=3,
        max_tokens=6,
        min_tokens=min_tokens,
        stop_token_ids=(stop,),
        length_penalty=length_penalty,
        include_stop_str_in_output=include,
    )
    out = llm.beam_search([prompt], params)[0]
    ending = {stop, *llm.engine.eos_token_ids}
    ref = reference_beam_search(model, prompt, 3, 6, ending, min_tokens, length_penalty, include)
    assert [s.tokens[len(prompt) :] for s in out.sequences] == [r[0] for r in ref]
    assert [s.cum_logprob for s in out.sequences] == pytest.approx([r[1] for r in ref], abs=1e-4)
    assert [s.finish_reason for s in out.sequences] == ["stop" if r[2] else "length" for r in ref]
    assert any(r[2] for r in ref), "the case must end some beam by its stop token"
    for s, r in zip(out.sequences, ref, strict=True):
        if r[2]:
            assert s.stop_reason == stop
            assert (s.tokens[-1] == stop) is include


def test_search_ends_once_no_live_beam_can_make_the_answer(llm, hf_model, tiny_llama: Path) -> None:
    # Without a length penalty a beam's score only falls: once three ended beams beat every live
    # one, the rest of max_tokens cannot change the answer (the reference runs it all).
    model = hf_model(tiny_llama)
    prompt = PROMPTS[0]
    likely = _likely_tokens(model, prompt)
    params = BeamSearchParams(
        beam_width=2, max_tokens=40, stop_token_ids=tuple(likely[:2]), length_penalty=0.0
    )
    search = BeamSearch(prompt, params, llm.engine.eos_token_ids, llm.tokenizer)
    while not search.done:
        step = search.step_params()
        search.advance([_step_logprobs(model, beam.tokens, step.logprobs) for beam in search.live])
    assert search.steps < 40
    out = search.finish()
    ref = reference_beam_search(model, prompt, 2, 40, {*likely[:2], *llm.engine.eos_token_ids}, 0, 0.0)
    assert [s.tokens[len(prompt) :] for s in out.sequences] == [r[0] for r in ref]
    assert [s.finish_reason for s in out.sequences] == ["stop", "stop"]


def _step_logprobs(model, tokens: list[int], k: int) -> dict[int, Logprob]:
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, -1].float()
    values, ids = torch.log_softmax(logits, -1).topk(k)
    return {
        t: Logprob(v, rank) for rank, (t, v) in enumerate(zip(ids.tolist(), values.tolist(), strict=True), 1)
    }


# -- the rules, on hand-made steps -----------------------------------------------------------------


def _position(*entries: tuple[int, float]) -> dict[int, Logprob]:
    return {tid: Logprob(lp, rank) for rank, (tid, lp) in enumerate(entries, 1)}


def _ids(tokenizer: Tokenizer, *texts: str) -> list[int]:
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    assert all(len(i) == 1 for i in ids), ids
    return [i[0] for i in ids]


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_ends_a_beam_and_the_next_candidate_takes_its_place(tokenizer, include) -> None:
    a, b, x, y = _ids(tokenizer, "a", "b", "x", "y")
    params = BeamSearchParams(beam_width=2, max_tokens=3, stop=("xy",), include_stop_str_in_output=include)
    search = BeamSearch([5, 6], params, [2], tokenizer)
    search.advance([_position((x, -0.1), (a, -1.0), (b, -2.0), (y, -3.0))])
    assert [beam.tokens[2:] for beam in search.live] == [[x], [a]]
    # From "x": "y" completes "xy" (a stop); "a" and "x" stay live, as does "ab" from "a".
    search.advance([_position((y, -0.2), (a, -0.3), (x, -5.0), (b, -6.0)), _position((b, -0.1), (a, -4.0))])
    assert [beam.tokens[2:] for beam in search.live] == [[x, a], [a, b]]
    assert [(c.tokens[2:], c.text, c.stop_reason) for c in search.completed] == [
        ([x, y], "xy" if include else "", "xy")
    ]
    assert search.completed[0].cum_logprob == pytest.approx(-0.3)


def test_min_tokens_holds_back_ending_tokens(tokenizer) -> None:
    a, b = _ids(tokenizer, "a", "b")
    search = BeamSearch([5], BeamSearchParams(beam_width=1, max_tokens=3, min_tokens=1), [2], tokenizer)
    search.advance([_position((2, -0.1), (a, -1.0), (b, -2.0))])  # EOS first: not yet allowed
    assert search.completed == [] and [beam.tokens for beam in search.live] == [[5, a]]
    search.advance([_position((2, -0.1), (b, -2.0))])
    assert [(c.tokens, c.finish_reason, c.stop_reason) for c in search.completed] == [([5, a], "stop", None)]
    assert search.completed[0].cum_logprob == pytest.approx(-1.1)


def test_length_penalty_decides_between_short_and_long_beams(tokenizer) -> None:
    a, b = _ids(tokenizer, "a", "b")

    def run(penalty: float) -> list[list[int]]:
        params = BeamSearchParams(beam_width=1, max_tokens=2, length_penalty=penalty)
        search = BeamSearch([5, 6], params, [2], tokenizer)
        search.advance([_position((a, -0.5), (2, -1.2))])  # "a" lives; EOS ends at -1.2, length 2
        search.advance([_position((b, -1.0), (2, -9.0))])  # "ab": -1.5 over length 4
        return [beam.tokens[2:] for beam in search.finish().sequences]

    # -1.2 / 2 = -0.6 loses to -1.5 / 4 = -0.375; without the penalty -1.2 beats -1.5.
    assert run(1.0) == [[a, b]]
    assert run(0.0) == [[]]


def test_logprobs_carry_the_chosen_token_and_the_top_n(tokenizer) -> None:
    a, b, x = _ids(tokenizer, "a", "b", "x")
    params = BeamSearchParams(beam_width=2, max_tokens=1, logprobs=1)
    search = BeamSearch([5], params, [2], tokenizer)
    search.advance([_position((a, -0.1), (b, -0.5), (x, -3.0))])
    best, second = search.finish().sequences
    assert best.logprobs == [{a: Logprob(-0.1, 1)}]
    assert second.logprobs == [{b: Logprob(-0.5, 2), a: Logprob(-0.1, 1)}]
    assert (best.text, second.text) == ("a", "b")
    assert math.isclose(second.cum_logprob, -0.5)


def test_bad_params_are_value_errors(tokenizer) -> None:
    for bad in (
        {"beam_width": 0},
        {"max_tokens": 0},
        {"min_tokens": 9},
        {"length_penalty": math.inf},
        {"stop": ("",)},
    ):
        with pytest.raises(ValueError):
            BeamSearch([5], BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **bad}), [2], tokenizer)


def test_prompt_and_max_tokens_beyond_the_context_is_a_value_error(llm) -> None:
    with pytest.raises(ValueError, match="exceed the model's context"):
        llm.beam_search([[5] * 10], BeamSearchParams(beam_width=2, max_tokens=llm.engine.max_model_len))
