"""Deterministic mode at realistic layer widths on CPU: a row's linear-layer result, and so a
request's logits, must not depend on how many rows share the matmul.

The session's tiny checkpoints (hidden size 64) cannot show it: MKL, with more than one thread,
splits a long input's matmul across its threads another way once K reaches about a thousand and M a
few hundred, which changes a row's summation order. A prompt computed in one step then gets other
logits than the same prompt chunked, batched or decoded beside others.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.demo import build_model
from engine.models.decoder import invariant_linear


@pytest.fixture
def two_threads():
    """MKL's split of a long matmul across threads is what changes a row's result."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("two_threads")
def test_invariant_linear_rows_do_not_depend_on_the_row_count() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(2048, 2048, generator=gen)
    bias = torch.randn(2048, generator=gen)
    x = torch.randn(600, 2048, generator=gen)
    alone = torch.cat([invariant_linear(x[i : i + 1], weight, bias) for i in (0, 299)])
    for m in (1, 15, 16, 17, 40, 300, 600):
        out = invariant_linear(x[:m], weight, bias)
        assert out.shape == (m, 2048)
        assert torch.equal(out[0], alone[0]), m
        if m >= 300:
            assert torch.equal(out[299], alone[1]), m


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One Llama layer 2048 wide: the width of a 1B model."""
    return build_model(
        tmp_path_factory.mktemp("wide") / "llama",
        "llama",
        seed=0,
        hidden_size=2048,
        intermediate_size=2048,
        num_hidden_layers=1,
        num_attention_heads=16,
        num_key_value_heads=4,
    )


@pytest.mark.usefixtures("two_threads")
def test_a_prompt_has_the_same_logits_in_one_step_and_chunked(wide_llama: Path) -> None:
    rng = random.Random(0)
    prompt = [rng.randrange(3, 1000) for _ in range(300)]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=3)
    results = []
    for budget in (2048, 64):  # the prompt in one 300-row step; in 64-row chunks
        llm = LLM(
            str(wide_llama),
            deterministic=True,
            num_kv_blocks=32,
            enable_prefix_caching=False,
            max_num_batched_tokens=budget,
        )
        logits: list[torch.Tensor] = []
        llm.engine.logits_observers.append(lambda ids, rows, seen=logits: seen.append(rows.clone()))
        out = llm.generate([prompt], params)[0].outputs[0]
        llm.engine.block_manager.check_integrity()
        assert llm.engine.block_manager.num_used_blocks == 0
        results.append(
            (
                torch.cat(logits),
                out.token_ids,
                [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs, strict=True)],
            )
        )
    (whole, tokens_a, lps_a), (chunked, tokens_b, lps_b) = results
    assert torch.equal(whole, chunked)
    assert tokens_a == tokens_b
    assert lps_a == lps_b
