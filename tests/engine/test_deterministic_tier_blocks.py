"""The KV tier keeps a deterministic engine's blocks apart from a default engine's.

Deterministic mode computes every projection batch-invariantly (``invariant_linear``): its K/V
bytes differ from those of the default linear, whose rows also depend on the batch. A
deterministic engine that loaded a default engine's blocks from a shared tier would continue
from other bytes than it computes itself, and its tokens and logprobs would no longer be those
of the prefix recomputed. The model fingerprint (the tier key's namespace) tells them apart.
"""

from __future__ import annotations

from engine import LLM, SamplingParams

BLOCK = 4
OPTIONS = {"block_size": BLOCK, "num_kv_blocks": 64}
PROMPTS = [list(range(10, 50)), list(range(100, 155)), list(range(200, 233))]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)


def _exact(outputs) -> list[list[tuple[int, float]]]:
    return [
        [(tok, lp.logprob) for entry in o.outputs[0].logprobs for tok, lp in entry.items()] for o in outputs
    ]


def test_deterministic_engine_never_loads_a_default_engines_blocks(tiny_llama) -> None:
    reference = _exact(LLM(str(tiny_llama), deterministic=True, **OPTIONS).generate(PROMPTS, PARAMS))
    tier = "memory://det-vs-default"
    # Chunks of 9 tokens: the default linear's rows differ from the padded invariant tiles.
    writer = LLM(str(tiny_llama), kv_tier=tier, max_num_batched_tokens=9, **OPTIONS)
    writer.generate(PROMPTS, PARAMS)
    assert writer.engine.connector.flush(5.0)
    assert writer.engine.connector.stats().blocks_saved > 0
    reader = LLM(str(tiny_llama), kv_tier=tier, deterministic=True, **OPTIONS)
    assert reader.engine.model_fingerprint != writer.engine.model_fingerprint
    assert _exact(reader.generate(PROMPTS, PARAMS)) == reference
    assert reader.engine.stats().prefix_cache_hits == 0  # nothing of the default engine's was read
    reader.engine.block_manager.check_integrity()
    assert reader.engine.block_manager.num_used_blocks == 0
    # Deterministic engines do share: a second one loads the first one's blocks, bit for bit.
    assert reader.engine.connector.flush(5.0)
    again = LLM(str(tiny_llama), kv_tier=tier, deterministic=True, **OPTIONS)
    assert again.engine.model_fingerprint == reader.engine.model_fingerprint
    assert _exact(again.generate(PROMPTS, PARAMS)) == reference
    assert again.engine.stats().prefix_cache_hits > 0
