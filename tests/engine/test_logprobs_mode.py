"""vLLM's ``logprobs_mode`` through the engine: raw logits are transformers' logits, processed
logprobs the distribution a sampled token was drawn from, and beam search keeps scoring by raw
log-probabilities whatever the mode."""

from __future__ import annotations

import math

from engine import LLM, SamplingParams
from engine.beam_search import BeamSearchParams

PROMPT = [5, 9, 13, 17, 21, 25, 29]


def test_raw_logits_are_the_models(tiny_llama, hf_reference) -> None:
    _, hf_logits = hf_reference(tiny_llama, PROMPT, 4)
    llm = LLM(str(tiny_llama), num_kv_blocks=32, logprobs_mode="raw_logits")
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, ignore_eos=True))[
        0
    ]
    for step, entry in enumerate(out.outputs[0].logprobs):
        token = out.outputs[0].token_ids[step]
        assert math.isclose(entry[token].logprob, hf_logits[step, token].item(), abs_tol=1e-4)
        assert entry[token].rank == 1  # greedy: the largest logit


def test_processed_logprobs_are_the_sampling_distribution(tiny_llama) -> None:
    params = SamplingParams(temperature=0.5, top_k=3, max_tokens=6, logprobs=5, seed=7, ignore_eos=True)
    raw = LLM(str(tiny_llama), num_kv_blocks=32).generate([PROMPT], params)[0].outputs[0]
    llm = LLM(str(tiny_llama), num_kv_blocks=32, logprobs_mode="processed_logprobs")
    processed = llm.generate([PROMPT], params)[0].outputs[0]
    assert processed.token_ids == raw.token_ids  # the mode changes what is reported, never the draw
    for step, entry in enumerate(processed.logprobs):
        finite = [lp.logprob for lp in entry.values() if lp.logprob > -math.inf]
        assert len(finite) == 3  # top-k 3: every other token of the 5 asked is -inf
        assert math.isclose(sum(math.exp(v) for v in finite), 1.0, abs_tol=1e-5)
        token = processed.token_ids[step]
        assert entry[token].logprob > raw.logprobs[step][token].logprob  # sharpened by temperature 0.5


def test_beam_search_scores_raw_logprobs_in_any_mode(tiny_llama) -> None:
    params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    want = LLM(str(tiny_llama), num_kv_blocks=64).beam_search([PROMPT], params)[0]
    got = LLM(str(tiny_llama), num_kv_blocks=64, logprobs_mode="raw_logits").beam_search([PROMPT], params)[0]
    assert [s.tokens for s in got.sequences] == [s.tokens for s in want.sequences]
    assert [s.cum_logprob for s in got.sequences] == [s.cum_logprob for s in want.sequences]
    assert all(s.cum_logprob < 0 for s in got.sequences)


def test_bad_modes_are_refused(tiny_llama) -> None:
    import pytest

    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        LLM(str(tiny_llama), num_kv_blocks=8, logprobs_mode="logits")
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        SamplingParams(logprobs_mode="nope").validate()
