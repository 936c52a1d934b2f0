"""N-gram speculative decoding (engine/spec_decode.py): the proposer's drafts exactly, and a
request's tokens and logprobs the same with drafts as without (greedy and seeded, with penalties,
stops, chunked budgets, preemption and structured outputs beside), while drafts are accepted."""

from __future__ import annotations

import json
from array import array

import pytest

from engine import LLM, SamplingParams
from engine.sampling_params import StructuredOutputsParams
from engine.spec_decode import NgramProposer, SpeculativeConfig

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def _propose(tokens: list[int], limit: int = 10, k: int = 3, high: int = 3, low: int = 1) -> list[int]:
    proposer = NgramProposer(SpeculativeConfig("ngram", k, high, low))
    return proposer.propose(array("i", tokens), limit)


def test_proposer_takes_the_longest_latest_earlier_match() -> None:
    # Suffix [2, 3]: the 2-gram occurs at index 1 and 6; the latest (6) is followed by 9, 9.
    assert _propose([1, 2, 3, 4, 5, 7, 2, 3, 9, 9, 8, 2, 3]) == [9, 9, 8]
    # The 3-gram [7, 2, 3] wins over the later 2-gram [2, 3].
    assert _propose([7, 2, 3, 5, 6, 1, 2, 3, 4, 4, 7, 2, 3]) == [5, 6, 1]
    assert _propose([7, 2, 3, 5, 6, 1, 2, 3, 4, 4, 7, 2, 3], limit=2) == [5, 6]
    assert _propose([1, 2, 3, 4]) == []  # nothing repeats
    assert _propose([5, 5]) == [5]  # what follows the match may be the suffix itself
    assert _propose([1, 2, 3, 1, 2], low=3) == []  # only 2-grams repeat
    assert _propose([9]) == [] and _propose([1, 1], limit=0) == []


def test_proposer_ignores_matches_across_token_boundaries() -> None:
    # As bytes, tokens [0x100, 0x10000] contain [0x1000000]'s encoding at an odd offset.
    tokens = [0x100, 0x10000, 42, 0x1000000]
    assert array("i", tokens).tobytes().find(array("i", [0x1000000]).tobytes()) % 4 != 0
    assert _propose(tokens) == []
    assert _propose([*tokens, 7, 0x1000000]) == [7, 0x1000000]


def test_config_parses_as_vllm() -> None:
    assert SpeculativeConfig.parse(None) is None
    assert SpeculativeConfig.parse(
        {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}
    ) == (SpeculativeConfig("ngram", 5, 4, 4))
    assert SpeculativeConfig.parse(json.dumps(SPEC)) == SpeculativeConfig("ngram", 4, 3, 1)
    assert SpeculativeConfig.parse({"num_speculative_tokens": 2}) == SpeculativeConfig("ngram", 2, 5, 5)
    for bad, match in (
        ({"method": "eagle", "num_speculative_tokens": 2}, "'eagle' is not supported"),
        ({"method": "ngram"}, "needs num_speculative_tokens"),
        ({"num_speculative_tokens": 0}, "integer >= 1"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "exceeds"),
        ({"num_speculative_tokens": 2, "draft": "x"}, "unknown field"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "only for method 'draft_model'"),
        ("{nope", "not valid JSON"),
    ):
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig.parse(bad)


def _prompts() -> list[list[int]]:
    loop = [7, 8, 9, 10, 11] * 12  # drafts match at once
    return [loop, [5, 6, 7], list(range(20, 120)), [3, 4] * 30 + [50, 51, 52]]


def _llms(path, **options) -> tuple[LLM, LLM]:
    base = LLM(str(path), num_kv_blocks=256, **options)
    spec = LLM(str(path), num_kv_blocks=256, speculative_config=SPEC, **options)
    return base, spec


def _same(a, b, logprobs: bool = False) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.outputs[0].text == y.outputs[0].text
        assert x.outputs[0].finish_reason == y.outputs[0].finish_reason
        if logprobs and x.outputs[0].logprobs is not None:
            assert [{t: e.logprob for t, e in s.items()} for s in x.outputs[0].logprobs] == [
                {t: e.logprob for t, e in s.items()} for s in y.outputs[0].logprobs
            ]


def test_drafts_change_nothing_but_the_number_of_steps(tiny_llama) -> None:
    base, spec = _llms(tiny_llama, deterministic=True)
    params = [
        SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=48, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0.7, seed=6, max_tokens=48, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(
            temperature=0.0, max_tokens=48, ignore_eos=True, presence_penalty=0.5, frequency_penalty=0.3
        ),
    ]
    prompts = [p for p in _prompts() for _ in params]
    mixed = params * len(_prompts())  # every prompt under every setting, in one batch
    _same(base.generate(prompts, mixed), spec.generate(prompts, mixed), logprobs=True)
    stats = spec.engine.stats()
    assert stats.spec_decode_num_accepted_tokens > 40  # the loops were drafted and accepted
    assert stats.spec_decode_num_draft_tokens > stats.spec_decode_num_accepted_tokens
    assert sum(stats.spec_decode_accepted_per_position) == stats.spec_decode_num_accepted_tokens
    assert stats.spec_decode_accepted_per_position[0] >= stats.spec_decode_accepted_per_position[-1]
    # Fewer steps: drafts accepted mean tokens produced several at a time.
    assert spec.engine.generation_tokens_total == base.engine.generation_tokens_total
    spec.engine.block_manager.check_integrity()
    assert spec.engine.block_manager.num_used_blocks == 0


def test_stops_inside_accepted_drafts_end_where_they_would(tiny_llama) -> None:
    base, spec = _llms(tiny_llama, deterministic=True)
    free = base.generate(_prompts()[:2], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    prompts, cases = [], []
    for out in free:
        stop_id = out.outputs[0].token_ids[9]  # a token the output reaches mid-stream
        for p in (
            SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id]),
            SamplingParams(
                temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id], min_tokens=12
            ),
            SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True),
            SamplingParams(
                temperature=0.0, max_tokens=30, ignore_eos=True, stop=[out.outputs[0].text[-6:-2]]
            ),
        ):
            prompts.append(out.prompt_token_ids)
            cases.append(p)
    _same(base.generate(prompts, cases), spec.generate(prompts, cases))
    assert spec.engine.stats().spec_decode_num_accepted_tokens > 0
    assert spec.engine.block_manager.num_used_blocks == 0


def test_small_budgets_preemption_and_structured_outputs_beside(tiny_llama) -> None:
    # 8 tokens a step for 4 sequences (drafts cut to what fits), 16 blocks of 16 (requests preempted
    # and recomputed).
    options = {"deterministic": True, "max_num_batched_tokens": 8, "num_kv_blocks": 16, "max_num_seqs": 4}
    base = LLM(str(tiny_llama), **options)
    spec = LLM(str(tiny_llama), speculative_config=SPEC, **options)
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    _same(base.generate(prompts, params), spec.generate(prompts, params))
    assert spec.engine.scheduler.num_preemptions > 0
    assert spec.engine.stats().spec_decode_num_accepted_tokens > 0
    choice = SamplingParams(
        temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])
    )
    mixed = [params] * len(prompts) + [choice]
    a, b = base.generate([*prompts, [5, 6]], mixed), spec.generate([*prompts, [5, 6]], mixed)
    _same(a, b)
    assert b[-1].outputs[0].text in ("yes", "no")
    spec.engine.block_manager.check_integrity()
    assert spec.engine.block_manager.num_used_blocks == 0


def test_accepted_drafts_are_cached_as_prefix_blocks(tiny_llama) -> None:
    spec = LLM(str(tiny_llama), num_kv_blocks=256, speculative_config=SPEC)
    prompt = _prompts()[0]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    first = spec.generate([prompt], params)[0]
    assert spec.engine.stats().spec_decode_num_accepted_tokens > 0
    again = spec.generate([prompt + first.outputs[0].token_ids[:32]], SamplingParams(max_tokens=1))[0]
    # The prompt and the first 32 output tokens (drafted ones among them) are 92 tokens: 5 full blocks.
    assert again.num_cached_tokens == 80
