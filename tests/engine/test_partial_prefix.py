"""Reuse of cached partial blocks end to end (engine/scheduler.py, ``partial_prefix_caching``):
greedy tokens with reuse equal those without it and transformers', on Llama and on DeepSeek's MLA
latent cache, with fp8 caches too; beam search gives the same beams and computes one token per beam
per step instead of recomputing each beam's last partial block."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine import LLM, BeamSearchParams, SamplingParams

MAX_NEW = 6
OPTIONS = {"num_kv_blocks": 64, "num_threads": 1}


@pytest.mark.parametrize(
    ("model_fixture", "kv_cache_dtype"),
    [("tiny_llama", "auto"), ("tiny_deepseek", "auto"), ("tiny_llama", "fp8"), ("tiny_deepseek", "fp8")],
)
def test_turns_extending_each_other_mid_block_give_the_same_tokens(
    model_fixture: str, kv_cache_dtype: str, hf_reference, request
) -> None:
    path = request.getfixturevalue(model_fixture)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    rng = random.Random(1)
    prompt = [rng.randrange(3, 200) for _ in range(21)]
    with (
        LLM(str(path), kv_cache_dtype=kv_cache_dtype, **OPTIONS) as on,
        LLM(str(path), kv_cache_dtype=kv_cache_dtype, partial_prefix_caching=False, **OPTIONS) as off,
    ):
        computed = 0  # tokens with KV the previous turn left: all but its last sampled one
        for _ in range(3):
            a, b = on.generate([prompt], params)[0], off.generate([prompt], params)[0]
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            if kv_cache_dtype == "auto":
                assert a.outputs[0].token_ids == hf_reference(path, prompt, MAX_NEW)[0]
            # Prompts of 21, 32, 43 tokens: the previous turn's 26, 37 computed tokens end inside
            # a block, which only partial reuse serves.
            assert a.num_cached_tokens == computed
            assert b.num_cached_tokens == computed // 16 * 16
            computed = len(prompt) + MAX_NEW - 1
            prompt = prompt + a.outputs[0].token_ids + [rng.randrange(3, 200) for _ in range(5)]
        for llm in (on, off):
            llm.engine.block_manager.check_integrity()
            assert llm.engine.block_manager.num_used_blocks == 0
        # The turns computed 26, 37 and 48 tokens: two partial blocks kept, the last turn's block full.
        assert on.engine.block_manager.num_partial_blocks == 2
        assert off.engine.block_manager.num_partial_blocks == 0
        # Copied, not recomputed: 26 - 16 and 37 - 32 tokens.
        assert on.engine.stats().partial_prefix_hits == 10 + 5
        assert off.engine.stats().partial_prefix_hits == 0


PROMPTS = [[5, 9, 14, 3, 77], [400, 12, 800, 33, 7, 91, 250, 61, 17, 500, 42, 8, 311, 29, 640, 71, 99]]


def test_beam_search_is_unchanged_and_computes_one_token_per_beam_step(tiny_llama: Path) -> None:
    width, steps = 3, 8
    params = BeamSearchParams(beam_width=width, max_tokens=steps, ignore_eos=True)
    beams, computed, hits, partial_hits = [], [], [], []
    for partial in (True, False):
        with LLM(str(tiny_llama), num_kv_blocks=128, num_threads=1, partial_prefix_caching=partial) as llm:
            outs = llm.beam_search(PROMPTS, params)
            beams.append([[s.tokens for s in out.sequences] for out in outs])
            stats = llm.engine.stats()
            computed.append(stats.iteration_tokens_sum)
            hits.append(stats.prefix_cache_hits)
            partial_hits.append(stats.partial_prefix_hits)
            llm.engine.block_manager.check_integrity()
    assert beams[0] == beams[1]
    # With reuse: the prompts once, then one token per live beam per step.
    assert computed[0] == sum(map(len, PROMPTS)) + (steps - 1) * width * len(PROMPTS)
    # Without it each step recomputes every beam's last partial block (all of the short prompt's).
    assert computed[1] > 3 * computed[0]
    assert hits[0] - hits[1] == computed[1] - computed[0]
    assert partial_hits == [hits[0] - hits[1], 0]  # the difference is all partial reuse


@pytest.mark.parametrize("model_fixture", ["tiny_llama", "tiny_deepseek"])
def test_random_conversations_under_preemption_match_without_reuse(model_fixture: str, request) -> None:
    """Differential: random multi-turn conversations (each turn the last prompt, its answer and new
    tokens), greedy and seeded, on a cache small enough to preempt, give the same tokens with and
    without partial reuse, and the block manager stays consistent."""
    path = request.getfixturevalue(model_fixture)
    options = {
        "num_kv_blocks": 24,  # 96 tokens for up to 4 sequences of up to 70: preemption
        "block_size": 4,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 16,
        "num_threads": 1,
        "deterministic": True,
    }
    rng = random.Random(7)
    with LLM(str(path), **options) as on, LLM(str(path), partial_prefix_caching=False, **options) as off:
        for _ in range(40):
            convs = [
                [rng.randrange(3, 200) for _ in range(rng.randint(1, 9))] for _ in range(rng.randint(1, 4))
            ]
            for _turn in range(rng.randint(1, 4)):
                params = SamplingParams(
                    max_tokens=rng.randint(1, 10),
                    temperature=rng.choice([0.0, 0.9]),
                    seed=rng.randrange(1000),
                    ignore_eos=True,
                )
                got, want = on.generate(convs, params), off.generate(convs, params)
                assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
                convs = [
                    (
                        c
                        + list(o.outputs[0].token_ids)
                        + [rng.randrange(3, 200) for _ in range(rng.randint(0, 5))]
                    )[-60:]
                    for c, o in zip(convs, got, strict=True)
                ]
            on.engine.scheduler.block_manager.check_integrity()
        with_reuse, without = on.engine.stats(), off.engine.stats()
    assert with_reuse.prefix_cache_hits > without.prefix_cache_hits  # reuse happened
    assert with_reuse.num_preemptions > 0  # and under preemption


def test_a_partial_hit_never_keeps_a_request_that_needs_every_block_waiting(tiny_llama: Path) -> None:
    """The cached partial block is pinned while the request's blocks are allocated; when the request
    needs every block of the cache, that pin alone made the allocation fail at every step (no running
    request to preempt): the request, and every one behind it, waited for ever. It now runs without
    the hit, with the tokens it gets with partial reuse off."""
    rng = random.Random(0)
    first = [rng.randrange(3, 1000) for _ in range(40)]  # leaves 40 - 32 = 8 tokens in a partial block
    second = first + [rng.randrange(3, 1000) for _ in range(23)]  # 63 + 1 tokens: all 4 blocks
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    tokens = []
    for partial in (True, False):
        with LLM(
            str(tiny_llama), num_kv_blocks=4, block_size=16, num_threads=1, partial_prefix_caching=partial
        ) as llm:
            engine = llm.engine
            llm.generate([first], params)
            assert engine.block_manager.num_partial_blocks == (1 if partial else 0)
            engine.add_request(engine.make_request("second", second, params))
            outs = [o for _ in range(3) for o in engine.step() if o.finished]
            assert [o.request_id for o in outs] == ["second"]
            tokens.append(outs[0].outputs[0].token_ids)
            assert engine.stats().partial_prefix_hits == 0  # no room to copy the partial block
            assert engine.block_manager.num_used_blocks == 0
            engine.block_manager.check_integrity()
    assert tokens[0] == tokens[1]
