"""Same greedy tokens whatever path a request takes: prefix-cache hit, chunked prefill, preemption."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_llama, prompts) -> list[list[int]]:
    llm = LLM(str(tiny_llama), num_kv_blocks=256, enable_prefix_caching=False)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _assert_idle(llm: LLM) -> None:
    bm = llm.engine.block_manager
    bm.check_integrity()
    assert bm.num_used_blocks == 0
    assert not llm.engine.has_unfinished_requests()


def test_prefix_cache_hit_gives_identical_tokens(tiny_llama, prompts, reference) -> None:
    llm = LLM(str(tiny_llama), num_kv_blocks=256)
    first = llm.generate(prompts, GREEDY)
    assert _tokens(first) == reference
    assert [o.num_cached_tokens for o in first] == [0] * len(prompts)
    again = llm.generate(prompts, GREEDY)
    assert _tokens(again) == reference
    # Every full block of each prompt is reused, except that the last prompt token is always computed.
    assert [o.num_cached_tokens for o in again] == [((len(p) - 1) // 16) * 16 for p in prompts]
    stats = llm.engine.stats()
    assert stats.prefix_cache_queries == 2 * sum(len(p) for p in prompts)
    assert stats.prefix_cache_hits == sum(o.num_cached_tokens for o in again)
    _assert_idle(llm)


def test_shared_prefix_between_different_prompts(tiny_llama, prompts) -> None:
    llm = LLM(str(tiny_llama), num_kv_blocks=256)
    base = prompts[-1][:96]
    a = base + [7, 8, 9]
    b = base + [10, 11]
    ref = LLM(str(tiny_llama), num_kv_blocks=256, enable_prefix_caching=False).generate([a, b], GREEDY)
    out_a = llm.generate(a, GREEDY)[0]
    out_b = llm.generate(b, GREEDY)[0]
    assert out_b.num_cached_tokens == 96
    assert [out_a.outputs[0].token_ids, out_b.outputs[0].token_ids] == _tokens(ref)
    _assert_idle(llm)


@pytest.mark.parametrize("budget", [7, 16, 33])
def test_chunked_prefill_gives_identical_tokens(tiny_llama, prompts, reference, budget: int) -> None:
    llm = LLM(str(tiny_llama), num_kv_blocks=256, max_num_batched_tokens=budget)
    steps: list[int] = []
    engine = llm.engine
    orig = engine.scheduler.schedule

    def spy():
        out = orig()
        steps.append(out.num_batched_tokens)
        return out

    engine.scheduler.schedule = spy
    assert _tokens(llm.generate(prompts, GREEDY)) == reference
    assert max(steps) <= budget
    _assert_idle(llm)


def test_preemption_recomputes_and_every_request_finishes(tiny_llama, prompts, reference) -> None:
    # 30 blocks of 16 cannot hold all ten prompts (plus outputs) at once: requests get preempted.
    llm = LLM(str(tiny_llama), num_kv_blocks=30, max_num_batched_tokens=256)
    outs = llm.generate(prompts, GREEDY)
    assert _tokens(outs) == reference
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert llm.engine.stats().num_preemptions > 0
    _assert_idle(llm)


def test_preemption_without_prefix_cache(tiny_llama, prompts, reference) -> None:
    llm = LLM(str(tiny_llama), num_kv_blocks=24, enable_prefix_caching=False)
    assert _tokens(llm.generate(prompts, GREEDY)) == reference
    assert llm.engine.stats().num_preemptions > 0
    _assert_idle(llm)


def test_max_num_seqs_bounds_the_running_set(tiny_llama, prompts, reference) -> None:
    llm = LLM(str(tiny_llama), num_kv_blocks=256, max_num_seqs=3)
    engine = llm.engine
    seen: list[int] = []
    orig = engine.scheduler.schedule

    def spy():
        out = orig()
        seen.append(len(out.scheduled))
        return out

    engine.scheduler.schedule = spy
    assert _tokens(llm.generate(prompts, GREEDY)) == reference
    assert max(seen) == 3
    _assert_idle(llm)


def test_integrity_after_mixed_lengths_and_n(tiny_llama, prompts) -> None:
    llm = LLM(str(tiny_llama), num_kv_blocks=40)
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=20, n=3, ignore_eos=True)
    outs = llm.generate(prompts[:6], params)
    assert [len(o.outputs) for o in outs] == [3] * 6
    assert all(len(c.token_ids) == 20 for o in outs for c in o.outputs)
    _assert_idle(llm)


def test_choices_of_one_prompt_compute_it_once(tiny_llama, prompts, reference) -> None:
    """n > 1 (and any burst of one prefix): the first choice computes the prompt, the others wait
    for its blocks instead of recomputing them, and get the same tokens."""
    llm = LLM(str(tiny_llama), num_kv_blocks=256)
    p = max(prompts, key=len)
    cached = ((len(p) - 1) // 16) * 16
    assert cached >= 64
    out = llm.generate(p, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, n=4))[0]
    assert [c.token_ids for c in out.outputs] == [reference[prompts.index(p)]] * 4
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits == 3 * cached  # choices 2..4 reuse every full block
    assert llm.engine.scheduler.num_prefix_waits >= 3
    _assert_idle(llm)


def test_long_prefill_token_threshold_gives_identical_tokens(tiny_llama, prompts, reference) -> None:
    llm = LLM(str(tiny_llama), num_kv_blocks=256, long_prefill_token_threshold=5)
    sizes: list[int] = []
    orig = llm.engine.model_runner.execute

    def execute(sched):
        sizes.extend(s.num_new_tokens for s in sched.scheduled)
        return orig(sched)

    llm.engine.model_runner.execute = execute
    assert _tokens(llm.generate(prompts, GREEDY)) == reference
    assert max(sizes) == 5
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        LLM(str(tiny_llama), num_kv_blocks=8, long_prefill_token_threshold=-1)
    _assert_idle(llm)
