"""A structured-outputs grammar whose mask costs the engine thread more than
``structured_outputs_mask_budget_ms`` a token is ended as it runs (``engine/grammar_matcher.py``):
the request finishes with "abort" and an error naming the cost, after the tokens its grammar allowed;
the other requests of the batch (plain or under a cheap grammar) get exactly their solo tokens.

The costly grammar is a real one: ``([^x]{0,10}){0,100}`` (nested bounded repetitions, which
xgrammar matches in every way a text splits among them) compiles in milliseconds and then costs
4-160 ms a token with the tests' 1000-token vocabulary (``bench/grammar_cost.py``'s way, measured
on a 2-core box), over 100 times the 1 ms budget set here; a cheap regex costs ~0.005 ms."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.grammar_matcher import BUDGET_WINDOW, BudgetedGrammar
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.sampling_params import StructuredOutputsParams as SO

COSTLY = SO(grammar="root ::= ([^x]{0,10}){0,100}")
PROMPTS = ["Hello world", "def f(x):", "import os"]


@pytest.fixture(scope="module")
def guarded(tiny_llama):
    engine = LLM(str(tiny_llama), num_kv_blocks=128, structured_outputs_mask_budget_ms=1)
    yield engine
    engine.close()


def _greedy(max_tokens: int, structured: SO | None = None) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, structured_outputs=structured
    )


def test_a_costly_grammar_is_ended_and_its_batch_neighbours_get_their_solo_tokens(
    guarded, tiny_llama
) -> None:
    plain, cheap = _greedy(24), _greedy(24, SO(regex="[a-z ]+"))
    costly, normal, cheap_out = (
        o.outputs[0] for o in guarded.generate(PROMPTS, [_greedy(24, COSTLY), plain, cheap])
    )
    # Ended by the time it has BUDGET_WINDOW tokens (sooner when one token alone cost 8 ms: how
    # many tokens that takes is the machine's speed).
    assert costly.finish_reason == "abort" and 1 <= len(costly.token_ids) <= BUDGET_WINDOW
    assert costly.error is not None
    assert costly.error.startswith("The structured outputs constraint was ended: enforcing it cost ")
    assert "above the 1 ms a token this server allows (--structured-outputs-mask-budget-ms)" in costly.error
    # The others ran to their length, token for token as alone (the cheap grammar under the same
    # budget is never ended: it costs microseconds a token).
    assert (normal.finish_reason, cheap_out.finish_reason) == ("length", "length")
    assert normal.error is None and cheap_out.error is None
    assert normal.token_ids == guarded.generate([PROMPTS[1]], plain)[0].outputs[0].token_ids
    assert cheap_out.token_ids == guarded.generate([PROMPTS[2]], cheap)[0].outputs[0].token_ids
    assert len(cheap_out.token_ids) == 24
    # Until it was ended the grammar applied as it does with no budget: the same tokens.
    unguarded = LLM(str(tiny_llama), num_kv_blocks=64, structured_outputs_mask_budget_ms=0)
    try:
        free = unguarded.generate([PROMPTS[0]], _greedy(BUDGET_WINDOW, COSTLY))[0].outputs[0]
    finally:
        unguarded.close()
    assert (free.finish_reason, len(free.token_ids), free.error) == ("length", BUDGET_WINDOW, None)
    assert free.token_ids[: len(costly.token_ids)] == costly.token_ids


def test_one_slow_token_is_not_enough_but_a_window_of_budget_in_one_is(guarded) -> None:
    """The costliest token of the window is left out (a first fill's cold caches, a page fault), so
    one slow token among cheap ones never ends a request; a cost that persists does, and so does
    one token that alone cost the whole window's budget (1 ms here: 8 ms)."""
    compiled = guarded.engine.grammars.compile(SO(regex="[a-z]+"))
    grammar = guarded.engine.grammars.matcher(compiled)
    assert isinstance(grammar, BudgetedGrammar)
    for _ in range(3):  # a slow token every BUDGET_WINDOW tokens: never two in one window
        grammar._charge(0.007)
        for _ in range(BUDGET_WINDOW - 1):
            grammar._charge(0.0001)
        assert grammar.error is None
    grammar._charge(0.007)
    grammar._charge(0.007)  # two in the window: (0.007 + 6 x 0.0001) / 7 s a token
    assert grammar.error is not None
    assert "cost 1.1 ms of the engine's time a token (mean of its last 8 tokens)" in grammar.error
    at_once = guarded.engine.grammars.matcher(compiled)
    at_once._charge(0.0081)  # its first token
    assert (
        at_once.error is not None
        and "cost 8.1 ms of the engine's time a token (its last token)" in at_once.error
    )


@pytest.mark.parametrize("bad", [-1, "5", True, float("nan")])
def test_the_budget_must_be_a_number_of_milliseconds(bad) -> None:
    with pytest.raises(
        ValueError, match="structured_outputs_mask_budget_ms must be a number of milliseconds"
    ):
        EngineConfig(model="x", structured_outputs_mask_budget_ms=bad)
