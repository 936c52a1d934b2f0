"""Random batches of sampling parameters, constraints and masks on a small cache (chunked prefill
and preemption): every request finishes within its budget, tokens obey the masks that do not
contradict each other, the grammar holds, and the block pool stays consistent."""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.sampling_params import StructuredOutputsParams as SO

REGEX = "[a-c]{2,5}"


@pytest.fixture(scope="module")
def llm(tiny_llama):
    engine = LLM(str(tiny_llama), num_kv_blocks=24, max_num_batched_tokens=64, block_size=4)
    yield engine
    engine.close()


def _params(vocab: int):
    ids = st.integers(0, vocab - 1)
    specs = st.sampled_from(
        [
            None,
            SO(regex=REGEX),
            SO(choice=["yes", "no"]),
            SO(regex="[0-9]+", after_token_id=5),
            SO(json_object=True),
        ]
    )
    return st.builds(
        SamplingParams,
        max_tokens=st.integers(1, 16),
        min_tokens=st.integers(0, 3),
        temperature=st.sampled_from([0.0, 0.7, 1.5]),
        top_p=st.sampled_from([1.0, 0.5]),
        top_k=st.sampled_from([-1, 1, 20]),
        min_p=st.sampled_from([0.0, 0.2]),
        presence_penalty=st.sampled_from([0.0, 1.5]),
        repetition_penalty=st.sampled_from([1.0, 1.3]),
        logit_bias=st.none() | st.dictionaries(ids, st.floats(-100, 100), max_size=3),
        seed=st.none() | st.integers(0, 50),
        ignore_eos=st.booleans(),
        allowed_token_ids=st.none() | st.lists(ids, min_size=1, max_size=5),
        bad_words_token_ids=st.none()
        | st.lists(st.lists(ids, min_size=1, max_size=2), min_size=1, max_size=2),
        structured_outputs=specs,
        n=st.integers(1, 2),
        logprobs=st.none() | st.integers(0, 2),
    )


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(data=st.data())
def test_random_batches_finish_and_obey(llm, data) -> None:
    engine = llm.engine
    vocab = engine.sampling_vocab_size
    batch = data.draw(
        st.lists(
            st.tuples(st.lists(st.integers(3, vocab - 1), min_size=1, max_size=40), _params(vocab)),
            min_size=1,
            max_size=5,
        )
    )
    prompts = [p for p, _ in batch]
    params = [p for _, p in batch]
    for p in params:
        p.min_tokens = min(p.min_tokens, p.max_tokens)
    try:
        outs = llm.generate(prompts, params)
    except ValueError:
        assert not engine.has_unfinished_requests()
        return
    for out, p in zip(outs, params, strict=True):
        assert len(out.outputs) == p.n
        for c in out.outputs:
            assert 1 <= len(c.token_ids) <= p.max_tokens and c.finish_reason in ("stop", "length")
            free = p.structured_outputs is None and not p.bad_words_token_ids and not p.min_tokens
            if p.allowed_token_ids and free:
                assert set(c.token_ids) <= set(p.allowed_token_ids) | set(engine.eos_token_ids)
            if p.structured_outputs == SO(regex=REGEX) and c.finish_reason == "stop":
                assert re.fullmatch(REGEX, c.text)
    assert not engine.has_unfinished_requests()
    engine.block_manager.check_integrity()
