"""A request waiting for KV blocks asks the tier once, not on every step it fails to get them.

Real tiny Llama and a real ``memory://`` tier; lookups are counted by the connector's own
``blocks_looked_up`` counter.
"""

from __future__ import annotations

from pathlib import Path

from engine import LLM, SamplingParams

BS = 16
PROMPT_A = [(11 * i + 5) % 900 + 10 for i in range(100)]  # not in the tier: 6 blocks asked
PROMPT_B = [(7 * i + 3) % 900 + 10 for i in range(80)]  # in the tier: 4 loadable blocks (of 5)
A_PARAMS = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
B_PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def test_waiting_request_reuses_its_tier_lookup(tiny_llama: Path) -> None:
    tier = "memory://lookup-cache"
    with LLM(str(tiny_llama), kv_tier=tier, block_size=BS, num_kv_blocks=64) as writer:
        cold_b = writer.generate([PROMPT_B], B_PARAMS)[0].outputs[0].token_ids
        assert writer.engine.connector.flush(10.0)
        # 10 blocks: A takes 7 to 9 of them while it runs, so B (5 blocks) waits until A finishes.
        with LLM(str(tiny_llama), kv_tier=tier, block_size=BS, num_kv_blocks=10) as llm:
            engine = llm.engine
            steps_waiting = 0
            original = engine.scheduler.schedule

            def schedule():  # noqa: ANN202 - counts steps that leave B waiting
                nonlocal steps_waiting
                out = original()
                if any(r.prompt_token_ids == PROMPT_B for r in engine.scheduler.waiting):
                    steps_waiting += 1
                return out

            engine.scheduler.schedule = schedule
            out_a, out_b = llm.generate([PROMPT_A, PROMPT_B], [A_PARAMS, B_PARAMS])
            assert steps_waiting >= 30  # B really retried admission on many steps
            # A asked for its 6 candidate blocks once, B for its 4 once (and its 5th, which holds
            # its last token: computed, and not written if the tier holds it), despite B's retries.
            assert engine.connector.stats().blocks_looked_up == 6 + 4 + 1
            assert out_b.num_cached_tokens == 4 * BS and out_b.outputs[0].token_ids == cold_b
            assert len(out_a.outputs[0].token_ids) == 40
