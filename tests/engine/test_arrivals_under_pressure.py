"""Requests arriving while others are mid-prefill, under memory pressure: shared prefixes whose hits
end on a block boundary, one token before it and one after, chunked prefill, preemption, and aborts
of a preempted and of a waiting request. The survivors give transformers' greedy tokens, and every
block comes back."""

from __future__ import annotations

import random

from engine import LLM, SamplingParams
from engine.sequence import RequestStatus

BLOCK = 4
MAX_NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(11)
    stem = [rng.randrange(3, vocab_size) for _ in range(5 * BLOCK)]

    def tail(n: int) -> list[int]:
        return [rng.randrange(3, vocab_size) for _ in range(n)]

    return [
        stem + tail(3),  # the first to run: its prompt blocks are what the others hit
        stem[: 3 * BLOCK] + tail(5),  # a hit ending on a block boundary
        stem[: 3 * BLOCK - 1] + tail(6),  # ... one token before it
        stem[: 3 * BLOCK + 1] + tail(4),  # ... one token after it
        stem + tail(2),  # all five stem blocks, arriving while the first computes them
        tail(9),  # nothing shared
    ]


def test_staggered_arrivals_preemption_and_aborts_match_transformers(
    tiny_llama, vocab_size, hf_reference
) -> None:
    prompts = _prompts(vocab_size)
    # Step at which each prompt arrives: the first is mid-prefill (chunks of 5) when the others come.
    arrivals = [0, 1, 1, 2, 2, 3]
    llm = LLM(str(tiny_llama), block_size=BLOCK, num_kv_blocks=12, max_num_batched_tokens=5)
    engine = llm.engine
    requests = {}
    aborted: set[int] = set()
    aborted_preempted = 0
    step = 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for i, at in enumerate(arrivals):
            if at == step:
                requests[i] = engine.make_request(f"r{i}", prompts[i], GREEDY)
                engine.add_request(requests[i])
        engine.step()
        step += 1
        for i, req in requests.items():
            if i in aborted or i == 0:
                continue
            if req.status is RequestStatus.PREEMPTED and not aborted_preempted:
                engine.abort_request(req.request_id)
                aborted.add(i)
                aborted_preempted += 1
        if step == 4 and requests[5].status is RequestStatus.WAITING:
            engine.abort_request("r5")
            aborted.add(5)
        assert step < 500, "the engine made no progress"
    # The scenario reached what it is about: an abort of a preempted request and of a waiting one,
    # and hits that end on a block boundary (12 of 17 tokens) and one token after it.
    assert aborted_preempted == 1 and 5 in aborted
    assert requests[1].num_cached_tokens == requests[3].num_cached_tokens == 3 * BLOCK
    assert engine.scheduler.num_preemptions > 0 and engine.scheduler.prefix_cache_hits > 0
    for i, req in requests.items():
        if i in aborted:
            assert req.finish_reason == "abort"
            continue
        assert req.output_token_ids == hf_reference(tiny_llama, prompts[i], MAX_NEW)[0], i
        assert req.finish_reason == "length"
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_used_blocks == 0
